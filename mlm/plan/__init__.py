"""`mlm plan`: choose the mesh (cp for long sequences, ep for MoE models), micro-batch, recompute and optimizer
sharding for a model on N GPUs from a memory and time model (torch-free: llama3-70b on 512 GPUs
plans in under a second, bench/plan_speed.py).

    hardware.py   a profile by name (the datasheet table in mlm.hardware) or a custom TOML
    job.py        the inputs (Job); a candidate is an `mlm.layout.Layout`
    memory.py     per-GPU memory by component, counting what mlm allocates
    timing.py     step time by term: compute, tp, ep all-to-all, cp exchange, p2p, bubble, dp,
                  optimizer
    search.py     enumerate valid layouts, rank those that fit by throughput
    candidates.py a family's layouts: memory first, only what fits timed, model state bounds
    memo.py       the terms many layouts share, computed once per search
    report.py     tables, --explain, the plan-file dict, --png
    calibrate.py  refit a profile to measured steps
"""
