"""What the benchmarks and the GPU check measure with, importable by name from tests and scripts.

- :mod:`.lost_time`: training time lost per checkpoint, and the A/B (real save vs sham) figure;
- :mod:`.thread_probe`: per-thread CPU, run-queue wait and wake-ups from ``/proc``;
- :mod:`.foreign_load`: other processes' CPU use during a run;
- :mod:`.bandwidth`: the persist path's per-byte costs and the storage's write bandwidth;
- :mod:`.figures`, :mod:`.targets`, :mod:`.tables`, :mod:`.plot`: the checkpoint benchmark's
  figures from its ranks' records, the targets it is held to, its tables and its chart;
- :mod:`.engines`, :mod:`.sizing`: the engines and settings compared, layers for a size;
- :mod:`.gpu_report`, :mod:`.machine`: the NVML report, what machine a run used;
- :mod:`.logs`: the closing lines of a device check's logs;
- :mod:`.one_rank`: the load benchmarks' one DeepSpeed rank, and a checkpoint copied into a keeper;
- :mod:`.adapters`, :mod:`.usage`, :mod:`.model`: how a benchmark rank saves with each engine,
  what it used, the model it trains (these three import torch).

The runnable benchmarks are ``scripts/bench_*.py``; their numbers are in ``docs/benchmarks.md``.
Importing this package imports none of its modules; of those, only :mod:`.adapters`, :mod:`.usage`
and :mod:`.model` import torch when imported, and matplotlib is imported only to draw.
"""
