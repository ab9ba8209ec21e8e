"""Notebook 05's engine exercise, the capstone (ex05_zero3_engine): the ZeRO-3 engine, trained
on ranks against zerolab.zero3.ZeRO3 (engine_run, engine_verdict)."""

from zerolab.grading.engine_model import engine_exercise

EXERCISES = [
    engine_exercise(
        "5.3", "ex05_zero3_engine", "ZeRO3Engine", "zero3",
        "the ZeRO-3 engine: units unsharded and resharded around forward and backward",
        "Each unit keeps only its shards at rest, its frozen buffer too. A forward pre-hook "
        "gathers the unit, a forward hook frees it and hooks its output, whose gradient hook "
        "gathers it again for backward; when its last gradient is accumulated, reduce-scatter "
        "(op=\"avg\") into the gradient shard (+=), drop the full gradients and free the unit "
        "again. Freeing must free the memory itself: autograd holds views of the parameters.",
        hints=("Free with flat.untyped_storage().resize_(0) and p.data = torch.empty(0); "
               "gather with resize_ back to padded_numel * element_size, then all_gather into "
               "flat and point each p.data at its view: autograd's saved views see the data "
               "again.",)),
]
