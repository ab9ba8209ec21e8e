"""Notebook 04's engine exercise (ex04_zero2_engine): the ZeRO-2 engine, trained on ranks
against zerolab.zero2.ZeRO2 (engine_run, engine_verdict)."""

from zerolab.grading.engine_model import engine_exercise

EXERCISES = [
    engine_exercise(
        "4.2", "ex04_zero2_engine", "ZeRO2Engine", "zero2",
        "the ZeRO-2 engine: reduce-scatter each bucket from its hook, step the shard, gather",
        "Parameters live in flat padded buffers, one per bucket; the optimizer steps this "
        "rank's shard of each (a view). A bucket's hook flattens its gradients, frees them, "
        "reduce-scatters (op=\"avg\") and adds the shard received into the shard's .grad; "
        "step() all-gathers every bucket after the optimizer step.",
        hints=("The shard is nn.Parameter(shard(flat, layout, rank)): a view, so the "
               "optimizer's in-place update lands in flat, which all_gather then completes "
               "from every rank's shard (from a copy of yours: input and output must not "
               "overlap).",
               "Keep each reduce-scatter's handle with its flattened input and received "
               "buffer; before flattening the next bucket, wait for the one in flight, add "
               "what it received into the shard's .grad (+=: several backward passes add "
               "up) and drop both buffers. step() waits for the last one first.")),
]
