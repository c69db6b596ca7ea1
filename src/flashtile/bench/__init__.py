"""`flashtile bench`: time flashtile against its peers, in the FlashAttention papers' convention.

    providers  what is compared, and whether each contender can run a given problem
    runner     the grid, timing, accuracy, memory, executed kernels, and the run header with ceilings
    report     the terminal table, the JSON file and the PNG plot
    decode     `--mode decode`: KV-cache decoding bandwidth
    fp8        `--fp8`: the error FP8 quantisation of q, k, v adds to attention (no timing)

The byte and FLOP accounting behind each row's roofline fraction lives in `flashtile.iomodel`.
"""
