/* The layouts of a library's structures as the compiler laid them out, for the ctypes mirrors
 * of src/llaisys/_native/structs.py: llaisys._native compares each mirror's size and field
 * offsets with these when it loads the library, and refuses a library that disagrees.
 *
 * A library lists its structures in one table (its layouts.c): per structure one LAYOUT_TYPE
 * entry, then one LAYOUT_FIELD entry per field in declaration order, written as one
 * LAYOUT(structure, field, field, ...) each, and exports
 *
 *   int64_t llaisys_<lib>_layout(const char *type, int64_t i, const char **field, int64_t *size)
 *
 * through layout_lookup: with i < 0 the size of `type`; with i >= 0 the offset of its i-th
 * field, whose name and size go to *field and *size; -1 for an unknown type or past its last
 * field. Header only: every library is built on its own. */
#ifndef LLAISYS_LAYOUT_H
#define LLAISYS_LAYOUT_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    const char *type;  /* the structure's name, as the Python side asks for it */
    const char *field; /* NULL: the entry of the structure itself (value = its size) */
    size_t value;      /* the size of the structure, or the offset of the field */
    size_t size;       /* the size of the field */
} layout_entry;

/* Through a second macro, so that T may itself be a macro naming the structure: its name is
 * taken after expansion. */
#define LAYOUT_TYPE(T) LAYOUT_TYPE_(T)
#define LAYOUT_FIELD(T, f) LAYOUT_FIELD_(T, f)
#define LAYOUT_TYPE_(T) {#T, NULL, sizeof(T), 0}
#define LAYOUT_FIELD_(T, f) {#T, #f, offsetof(T, f), sizeof(((T *)0)->f)}

/* LAYOUT(T, f1, f2, ...): the entries of structure T and of its fields f1, f2, ... in order.
 * LAYOUT_FIELDS_ writes the first field's entry and leaves LAYOUT_AGAIN_ LAYOUT_PARENS_ (T, rest),
 * which becomes a call of LAYOUT_FIELDS_ on the next rescan only (a macro cannot expand itself);
 * LAYOUT_EXPAND_ rescans 4^4 = 256 times, so a structure may list up to 256 fields. */
#define LAYOUT(T, ...) LAYOUT_TYPE(T), LAYOUT_EXPAND_(LAYOUT_FIELDS_(T, __VA_ARGS__))
#define LAYOUT_FIELDS_(T, f, ...) LAYOUT_FIELD(T, f) __VA_OPT__(, LAYOUT_AGAIN_ LAYOUT_PARENS_ (T, __VA_ARGS__))
#define LAYOUT_AGAIN_() LAYOUT_FIELDS_
#define LAYOUT_PARENS_ ()
#define LAYOUT_EXPAND_(...) LAYOUT_EXPAND3_(LAYOUT_EXPAND3_(LAYOUT_EXPAND3_(LAYOUT_EXPAND3_(__VA_ARGS__))))
#define LAYOUT_EXPAND3_(...) LAYOUT_EXPAND2_(LAYOUT_EXPAND2_(LAYOUT_EXPAND2_(LAYOUT_EXPAND2_(__VA_ARGS__))))
#define LAYOUT_EXPAND2_(...) LAYOUT_EXPAND1_(LAYOUT_EXPAND1_(LAYOUT_EXPAND1_(LAYOUT_EXPAND1_(__VA_ARGS__))))
#define LAYOUT_EXPAND1_(...) LAYOUT_EXPAND0_(LAYOUT_EXPAND0_(LAYOUT_EXPAND0_(LAYOUT_EXPAND0_(__VA_ARGS__))))
#define LAYOUT_EXPAND0_(...) __VA_ARGS__

static inline int64_t layout_lookup(const layout_entry *table, size_t n, const char *type, int64_t i,
                                    const char **field, int64_t *size) {
    for (size_t at = 0; at < n; at++) {
        if (table[at].field != NULL || strcmp(table[at].type, type) != 0) continue;
        if (i < 0) return (int64_t)table[at].value;
        for (size_t j = at + 1; j <= at + 1 + (size_t)i; j++)
            if (j >= n || table[j].field == NULL) return -1; /* past the last field */
        const layout_entry *e = &table[at + 1 + (size_t)i];
        if (field) *field = e->field;
        if (size) *size = (int64_t)e->size;
        return (int64_t)e->value;
    }
    return -1;
}

#endif
