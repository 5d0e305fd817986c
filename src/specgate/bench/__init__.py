"""specgate.bench: the benchmark method, as code with tests of its own; the scripts in bench/ are thin commands over it.

    workloads  the serving prompts and the default draft's held-out code and prose prompts
    lanes      a lane's setting (off, fixed=G, adaptive[:options], #tag twins), its label and policy, the lane order
    clients    ClosedLoop: C clients with no think time (sequenced: every server sent the same requests)
    lockstep   every lane its own server, stepped in turn on its own clock, with block barriers (the serving sweep)
    judges     pooled throughput, adaptive / the best other lane with bootstrap intervals, held-out pick, twin controls
    tables     markdown tables and the plot of a sweep; bench_perf.py runs summarised with their medians
    assisted   a full-vocabulary copy of a reduced draft, so transformers' assisted generation runs the same draft

Outputs are written under out/ (ignored by git) and regenerated, not committed; docs/BENCHMARKS.md holds the
latest tables with the command that produced each.
"""
