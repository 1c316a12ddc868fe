"""The plugin conformance check behind ``llaisys plugin check PATH``.

It loads the plugin and exercises its device API with data verified on the host: devices,
allocator sizes, allocation at odd request sizes, copies in every direction (sync and async),
memset, stream order, device synchronize, events across streams, host callbacks and memory
stats. Then it runs one decoder layer's chain of ops (embedding, rms_norm, q/k/v projections,
rope, attention, output projection, residual add, SwiGLU MLP, head, argmax) and a small
random-weight model on the plugin's device and on the CPU and compares them; ops without a
plugin kernel run through the CPU fallback. Last, it times that model's recorded decode step
on both and reports the per-token dispatch overhead (the step's time outside the kernels)
of the device next to the CPU's.

Every check asks only what the plugin contract allows: allocation sizes are rounded as the
caching allocator rounds them (request plus ``extra_padding_size``, up to a multiple of
``min_chunk_size``), and the memory a row holds at once stays within ``max_alloc_size`` and
the free memory the device reports; a row that cannot fit is scaled down or skipped with the
reason. Every call into the plugin runs on a worker thread watched by a timeout: a call that
does not return fails its row, naming the API, and the rows after it are skipped.

Each row is ``pass``, ``fallback`` (passed, through a fallback for a missing optional API),
``fail`` or ``skip``. The check fails when any row fails.

The package: ``report`` (rows and their printing), ``watchdog`` (calls into the plugin under a
timeout), ``device_checks`` (the rows), ``workloads`` (the decoder layer and the random models
the op rows run), ``rows`` (running them in order), ``cli`` (the command and its child process).
"""
from .cli import add_arguments, check_args, child_command, deadline, main, run_cli
from .device_checks import reserved_for
from .report import FAIL, FALLBACK, PASS, SKIP, CheckReport, CheckRow, format_row
from .rows import DEFAULT_TIMEOUT, run_check
from .workloads import decoder_layer_chain, random_model_run, write_random_qwen2

__all__ = ["FAIL", "FALLBACK", "PASS", "SKIP", "CheckReport", "CheckRow", "DEFAULT_TIMEOUT", "add_arguments",
           "check_args", "child_command", "deadline", "decoder_layer_chain", "format_row", "main", "random_model_run",
           "reserved_for", "run_check", "run_cli", "write_random_qwen2"]
