"""specgate.bench: the benchmark method, as code with tests of its own; the scripts in bench/ are thin commands over it.

    timing     medians, the middle run, timed calls, lanes taking turns (interleaved, or alternating A B, B A)
    generation one request timed in specgate's engine or in transformers' generate(), as one record shape
    workloads  the serving, overload and engine prompts and the default draft's held-out code and prose prompts
    lanes      a lane's setting (off, fixed=G, adaptive[:options], #tag twins), its label and policy, the lane order
    clients    ClosedLoop: C clients with no think time (sequenced: every server sent the same requests)
    lockstep   every lane its own server, stepped in turn on its own clock, with block barriers (the serving sweep)
    judges     pooled throughput, adaptive / the best other lane with bootstrap intervals, held-out pick, twin controls
    tables     markdown tables and the plot of a sweep; a bench_perf.py report; bench_perf.py runs with their medians
    assisted   a full-vocabulary copy of a reduced draft, so transformers' assisted generation runs the same draft;
               the benchmark of the draft lane against assisted generation (lanes, rotation, summary, tables)
    floor      the bandwidth probe, the bytes a decode step reads, the step against that floor, V(t), products by rows
    perf       bench_perf.py's lanes per dtype, their median runs and ratios, the theory comparison, make demo's RSS
    engine     one request in four lanes (own baseline and n-gram, transformers greedy and prompt lookup)
    draft      the default draft against its baseline: lanes, held-out prompts in turn, speedups and acceptance
    rows       wide verification forwards under the old and the new bf16 row limit, alternating
    verifier   the verifier's time per call next to one target step
    montecarlo the lesson's pure-Python loop against specgate.simulate, alternating runs
    overload   a `specgate serve` subprocess at a multiple of its capacity, and the checks of a PASS
    llamacpp   specgate against llama-server on the same GGUF: decode lanes, and served lanes (closed-loop HTTP
               clients at each concurrency, `specgate serve` vs `llama-server -np C`), best lane per engine, ratios

Outputs are written under out/ (ignored by git) and regenerated, not committed; docs/BENCHMARKS.md holds the
latest tables with the command that produced each.
"""
