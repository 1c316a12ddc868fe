/*
 * strings.c: the string arrays of a GGUF header (a vocabulary and its merges hold ~100k strings)
 * gathered in one pass. The Python loop in llaisys/models/loaders/gguf_file.py is the reference
 * this must agree with, and the path taken when this library is not built.
 *
 * An array's strings lie back to back, each a u64 byte count (in the file's byte order) and its
 * bytes. They are copied out with a 0 byte after each, so Python decodes them all at once and
 * splits the text at the 0s.
 */
#include <stdint.h>
#include <string.h>

#define GGUF_EXPORT __attribute__((visibility("default")))

static uint64_t read_u64(const uint8_t *p, int big_endian) {
  uint64_t v = 0;
  for (int i = 0; i < 8; i++) v |= (uint64_t)p[big_endian ? 7 - i : i] << (8 * i);
  return v;
}

/*
 * The `count` strings starting at data[pos] (data holds `size` bytes): when out is not NULL,
 * each string's bytes and a 0 byte are written to it (room for *out_len bytes, as a first call
 * with out NULL reports). *out_len: the bytes of all strings plus count. Returns the position
 * after the last string, or -1 when a string or a byte count runs past the end of data.
 */
GGUF_EXPORT int64_t llaisys_gguf_strings(const uint8_t *data, int64_t size, int64_t pos, int64_t count,
                                         int big_endian, uint8_t *out, int64_t *out_len) {
  uint64_t at = (uint64_t)pos, end = (uint64_t)size, written = 0;
  for (int64_t i = 0; i < count; i++) {
    if (end - at < 8) return -1;
    uint64_t n = read_u64(data + at, big_endian);
    at += 8;
    if (n > end - at) return -1;
    if (out != NULL) {
      memcpy(out + written, data + at, n);
      out[written + n] = 0;
    }
    written += n + 1;
    at += n;
  }
  *out_len = (int64_t)written;
  return (int64_t)at;
}
