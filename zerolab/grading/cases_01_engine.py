"""Notebook 01's engine exercise (ex01_ddp_engine): DDP as an engine, trained on ranks against
zerolab.ddp.DDP (engine_run, engine_verdict)."""

from zerolab.grading.engine_model import engine_exercise

EXERCISES = [
    engine_exercise(
        "1.3", "ex01_ddp_engine", "DDPEngine", "ddp",
        "DDP, the engine: buckets all-reduced from gradient hooks, overlapping backward",
        "Each bucket's gradients sit in one flat buffer (.grad are views of it); when its last "
        "gradient is accumulated, all-reduce the buffer with op=\"avg\", async_op=True; wait "
        "for the handles in step(), and before the next forward too: a second backward adds "
        "into the buffers, and zerolab.comm divides an average only when it is waited for.",
        hints=("In __init__: for p in trainable: p.register_post_accumulate_grad_hook(hook); "
               "the hook counts the gradients of p's bucket and, at the last one, issues the "
               "all-reduce and keeps its handle. __call__ and step() both wait for every "
               "handle kept (then clear the list).",)),
]
