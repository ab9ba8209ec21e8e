"""Notebook 01's engine exercise (ex01_ddp_engine): DDP as an engine, trained on ranks against
zerolab.ddp.DDP (engine_check)."""

from zerolab.grading.engine_model import engine_exercise

EXERCISES = [
    engine_exercise(
        "1.3", "ex01_ddp_engine", "DDPEngine", "ddp",
        "DDP, the engine: buckets all-reduced from gradient hooks, overlapping backward",
        "Each bucket's gradients sit in one flat buffer (.grad are views of it); when its last "
        "gradient is accumulated, all-reduce the buffer with op=\"avg\", async_op=True; step() "
        "waits for every handle, then steps the optimizer.",
        hints=("In __init__: for p in trainable: p.register_post_accumulate_grad_hook(hook); "
               "the hook counts the gradients of p's bucket and, at the last one, issues the "
               "all-reduce and keeps its handle.",)),
]
