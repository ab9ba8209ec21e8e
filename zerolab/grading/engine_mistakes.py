"""The mistakes the grader names in an engine exercise, each with its hint: by the finding that
shows it (parameters, memory at a moment of the step, collectives), and by stage.

Memory is named by when it is held and what holds it. `memory_mistake(stage, when, what)`:
when is "forward", "backward", "rest" (after step()) or "peak"; what is the category of the
extra bytes (engine_run.py sorts every live storage into: parameters, gradients, optimizer
state, parameters kept by autograd's saved tensors, activations, other).
"""

from __future__ import annotations

from zerolab.grading.mistakes import Mistake


def _m(kind: str, hint: str) -> Mistake:
    return Mistake(kind, hint, output="")


def ratio_mistakes(n: int, shown: str = "") -> list[tuple[float, Mistake]]:
    """Known ratios of the learner's update to the right one on N ranks, most likely first
    (`shown`: how N is written in the hints, default its value)."""
    shown = shown or str(n)
    return [(n, _m("gradients summed, not averaged",
                   f"Your update is {shown} times too large: the gradients were summed over the "
                   f"{shown} ranks, not averaged. Use op=\"avg\" (zerolab.comm divides by N after "
                   "the sum).")),
            (1 / n, _m("gradients averaged twice",
                       f"Your update is {shown} times too small: op=\"avg\" already divides "
                       "by N.")),
            (2, _m("a gradient counted twice",
                   "Your update is twice too large: a gradient reduced, or added into its shard, "
                   "twice (a hook that fires twice? a tied weight counted twice?).")),
            (n / 2, _m("divided by 2, not by N",
                       f"Your update is {shown}/2 times the right one: the sum over the ranks "
                       f"was divided by 2, which is N only on 2 ranks. Divide by the group's "
                       f"size (or use op=\"avg\").")),
            (0, _m("a parameter not stepped",
                   "Your update is zero: the optimizer did not step this parameter (is it in the "
                   "optimizer? ZeRO: was its shard all-gathered back?)."))]


STALE_UNITS = _m("units still gathered after backward: their parameters are stale",
                 "Your update is zero: the full parameters the model uses (and full_state_dict() "
                 "returns) are the ones from before the step. A unit left gathered after its "
                 "backward is not gathered again (unshard finds it gathered): reshard every unit "
                 "after its backward, so that the next use gathers the stepped shards.")
WRONG_UPDATE = _m("a wrong update",
                  "Each parameter takes one optimizer step on its averaged gradient: build the "
                  "optimizer with **optimizer_kwargs, and let every gradient reach it once.")
SPREAD = _m("a rank stepped another rank's shard",
            "Rank r owns shard r of each flat buffer, flat[r*shard_numel:(r+1)*shard_numel] "
            "(zerolab.sharding.shard(flat, layout, r)): it steps that shard with the gradient "
            "shard reduce_scatter gives rank r, and all_gather puts it back at the same place.")
NOT_AVERAGED = _m("gradients not averaged over the ranks",
                  "Each rank must step with the average of every rank's gradients: all-reduce "
                  "each bucket (op=\"avg\") and wait for it before the optimizer steps.")
TENSOR_HOOK = _m("a parameter's gradient reduced before it was accumulated",
                 "p.register_hook(fn) runs when a gradient is computed, before autograd adds it "
                 "into p.grad (and twice for a tied weight): the buffer is sent before it is "
                 "complete. Start the collective from p.register_post_accumulate_grad_hook.")
ACCUMULATION = _m("the second backward's gradients replaced the first's",
                  "Right with one backward per step, wrong with two: gradients of micro-batches "
                  "must add up until step(). Add what a reduction brings into the gradient "
                  "(shard.grad += received), never copy it over; zero gradients only in "
                  "zero_grad().")
FROZEN_TRAINED = _m("a frozen parameter trained",
                    "A frozen parameter (requires_grad=False) gets no gradient and no optimizer "
                    "state: leave it out of the buckets and of the optimizer (ZeRO-3: it has a "
                    "flat buffer of its own, gathered with its unit, never reduced nor stepped).")
STATE_DICT = _m("full_state_dict() incomplete",
                "full_state_dict() returns the model's state_dict() with full tensors, copied, "
                "on every rank: every key, the tied lm_head.weight too.")
LIVE_STATE_DICT = _m("full_state_dict() returned live tensors, not a copy",
                     "What full_state_dict() returns is saved while training goes on: it must be "
                     "a snapshot (v.detach().clone()), not the parameters themselves (or views "
                     "of them), which the next step changes or frees.")
TIED_TWICE = _m("a tied weight held twice",
                "The extra bytes are one shared Parameter (two module names): collect parameters "
                "with model.parameters(), which lists a shared one once; its post-accumulate-grad "
                "hook fires once, after both uses.")
WHOLE_OPTIMIZER = _m("optimizer state for the whole model",
                     "Build the optimizer on this rank's shards only: its state is then 1/N of "
                     "the model's.")
TAGS = _m("comm tags not '<stage>/<phase>/<name>'",
          "Tag each collective '<stage>/<phase>/<name>': the stage, the phase it is issued in "
          "(fwd, bwd or step) and the bucket or unit it moves, so that the log reads like the "
          "algorithm.")
NO_COMM = _m("no collective through zerolab.comm",
             "The grader sees the collectives that go through zerolab.comm (all_reduce, "
             "reduce_scatter, all_gather, with tag= and group=), not torch.distributed's own.")
BUCKETS_FORWARD = _m("buckets in forward order",
                     "Cut the buckets from the trainable parameters in reverse order "
                     "(reversed(...)): backward produces gradients last layer first, so that a "
                     "bucket is complete, and sent, while backward goes on.")
BUCKETS_OTHER = _m("buckets cut otherwise than the contract says",
                   "The trainable parameters in reverse order, a bucket closed once it holds "
                   "bucket_bytes (checked before adding the next parameter), a parameter never "
                   "split: the grader compares each collective's size with zerolab's.")
RANKS_DIFFER = _m("the ranks issued different collectives",
                  "Every rank must issue the same collectives, of the same sizes, in the same "
                  "order (a set of names iterates in another order in each process).")


def _forward_late(stage: str) -> Mistake:
    return _m("collectives in the wrong phase", {
        "ddp": "All-reduce each bucket during backward, from the post-accumulate-grad hook of "
               "its last parameter (async_op=True); step() only waits for them.",
        "zero2": "Reduce-scatter each bucket during backward, from the post-accumulate-grad "
                 "hook of its last parameter; all-gather the parameters in step(), after the "
                 "optimizer; nothing in forward: ZeRO-2 keeps the parameters whole.",
        "zero3": "ZeRO-3 gathers each unit before its forward and again before its backward, "
                 "and reduce-scatters its gradients right after its backward; nothing is "
                 "gathered in step(): the next forward gathers what it needs."}[stage])


PHASES = {
    ("ddp", "all_reduce", "step"): _m(
        "no overlap: all-reduce after backward",
        "Start each bucket's all-reduce during backward, from the post-accumulate-grad hook of "
        "its last parameter (async_op=True); step() only waits for them."),
    ("zero2", "reduce_scatter", "step"): _m(
        "reduce-scatter after backward",
        "Reduce-scatter each bucket during backward, from the post-accumulate-grad hook of its "
        "last parameter: waiting for step() keeps every full gradient alive at the peak."),
    ("zero2", "all_gather", "forward"): _m(
        "parameters gathered in forward",
        "ZeRO-2 keeps every parameter whole between steps: all-gather the shards once, in "
        "step(), after the optimizer; nothing in forward."),
    ("zero2", "all_reduce", "backward"): _m(
        "all-reduce instead of reduce-scatter",
        "ZeRO-2 reduce-scatters each bucket (each rank receives only its own shard, averaged) "
        "and all-gathers the parameters after the step: all-reducing the gradients sends 3Ψ, "
        "not 2Ψ."),
    ("zero3", "all_reduce", "backward"): _m(
        "all-reduce instead of reduce-scatter",
        "ZeRO-3 reduce-scatters each unit's gradients (each rank keeps only its own shard): an "
        "all-reduce sends twice the bytes and leaves the full gradient on every rank."),
    ("zero3", "all_gather", "step"): _m(
        "parameters gathered after step()",
        "At rest a rank holds only its shards: gather nothing in step(); the next forward "
        "gathers each unit when it needs it."),
    ("zero3", "reduce_scatter", "step"): _m(
        "every unit's gradient held until step(), reduced there",
        "Reduce-scatter each unit's gradients as soon as its backward is over (the "
        "post-accumulate-grad hook of its last gradient), then drop them and reshard the unit: "
        "held until step(), every unit's flat gradient is alive at the end of backward, 4Ψ."),
}
PADDING_NOT_ZERO = _m("padding not zeros",
                      "The padding of a flat buffer must hold zeros, in the gradients too: a "
                      "reduce-scatter sums every rank's padding into someone's shard, and "
                      "torch.empty (or a NaN) there reaches that rank's optimizer state and "
                      "parameters. Make the flat gradient buffer with torch.zeros (or zero "
                      "its padding).")
STATE_DICT_GATHERS_ALL = _m("full_state_dict() gathers every unit at once",
                            "Gather, copy out and free one unit at a time: a state dict "
                            "holds the copies, never the whole model gathered as well.")
STATE_DICT_MEMORY = _m("full_state_dict() holds more than one copy of the state",
                       "Copy each tensor once (detach().clone()) and return: no second "
                       "copy, no flat buffer of the whole model besides.")
BLOCKING = {
    "ddp": _m("no overlap: backward waits for each all-reduce",
              "Issue each bucket's all-reduce with async_op=True, keep its handle, and wait for "
              "the handles in step(): backward computes the next gradients meanwhile."),
    "zero2": _m("no overlap: backward waits for each reduce-scatter",
                "Issue each bucket's reduce-scatter with async_op=True and wait for it later "
                "(before the next bucket's, and in step()): backward computes the next "
                "gradients meanwhile."),
}


def phase_mistake(stage: str, op: str, phase: str, missing: bool) -> Mistake:
    """A collective in a phase where zerolab's engine issues none (or none where it does)."""
    known = PHASES.get((stage, op, phase))
    if known is not None and not missing:
        return known
    return _forward_late(stage)


_MEMORY = {
    ("ddp", "other"): _m(
        "gradient buffers copied for the all-reduce",
        "All-reduce each bucket's flat gradient buffer in place (the .grad are views of it): a "
        "copy per bucket, kept until its all-reduce is waited for, doubles the gradients."),
    ("ddp", "grads"): _m(
        "gradients copied out of the buckets",
        "DDP holds 4Ψ of gradients: let autograd accumulate into .grad views of the flat "
        "bucket buffers, rather than copying the gradients."),
    ("zero2", "grads"): _m(
        "full gradients not freed during backward",
        "Set p.grad = None for the bucket's parameters once their gradients are flattened: "
        "only the gradient shards stay."),
    ("zero2", "other"): _m(
        "flattened gradients kept: a reduce-scatter not waited for",
        "Wait for the previous bucket's reduce-scatter before flattening the next (and drop "
        "its flat buffer): with every bucket's flat gradient alive until step(), ZeRO-2 holds "
        "4Ψ of gradients at the end of backward, as DDP does."),
    ("zero3", "params"): _m(
        "units not freed after their use",
        "Reshard each unit right after its forward (a forward hook), and again after its "
        "backward: only the root and the unit computing are gathered at a time."),
    ("zero3", "kept params"): _m(
        "reshard dropped references instead of freeing the storage",
        "p.data = torch.empty(0) (or a new flat buffer) only drops references: autograd saved "
        "views of the parameters for backward, which keep the whole unit alive. Free the "
        "storage itself: flat.untyped_storage().resize_(0)."),
    ("zero3", "grads"): _m(
        "full gradients not freed after each unit's backward",
        "After a unit's reduce-scatter, free its full gradients (p.grad = None): only the "
        "gradient shards stay."),
    ("zero3", "other"): _m(
        "every unit's flattened gradient held until step()",
        "Reduce-scatter each unit's flat gradient as soon as its backward is over and drop it "
        "(wait for it there, or before the next unit's): only gradient shards stay."),
}
_AT_REST = {
    "params": _m("parameters left gathered after step()",
                 "At rest a rank holds only its shards: reshard every unit after its backward "
                 "(its frozen buffer too), and gather nothing in step()."),
    "grads": _m("full gradients kept after step()",
                "Set p.grad = None once a bucket's gradients are flattened: only the gradient "
                "shards stay."),
    "optimizer": WHOLE_OPTIMIZER,
    "other": _m("buffers kept after step()",
                "After step() a rank holds its model states only: drop every buffer made for "
                "a collective (flattened gradients, received chunks, copies) once it is done."),
}
FROZEN_GATHERED = _m("frozen parameters never resharded",
                     "A unit's frozen parameters are sharded and gathered like the others: "
                     "reshard their buffer too, or every rank holds the whole frozen layer at "
                     "rest.")


def memory_mistake(stage: str, when: str, what: str) -> Mistake | None:
    """The mistake that extra bytes of category `what`, held at `when`, show."""
    if what == "kept params" and stage == "zero3":
        return _MEMORY["zero3", "kept params"]
    if when == "rest":
        if stage != "zero3" and what == "params":
            return None
        return _AT_REST.get(what)
    if stage == "zero2" and when == "forward" and what == "grads":
        return _AT_REST["grads"]
    return _MEMORY.get((stage, what))


def known_mistakes(stage: str) -> tuple[Mistake, ...]:
    """Every kind of mistake the grader names for this stage (for `hint(..., all_levels=True)`)."""
    memory = [m for (s, _), m in _MEMORY.items() if s == stage]
    phases = [m for (s, _, _), m in PHASES.items() if s == stage]
    rest = [_AT_REST[k] for k in ("grads", "optimizer", "other")]
    if stage == "zero3":
        rest = [_AT_REST["params"], FROZEN_GATHERED, *rest]
    extra = [BUCKETS_FORWARD, BUCKETS_OTHER] if stage != "zero3" else []
    blocking = [BLOCKING[stage]] if stage in BLOCKING else []
    stale = [STALE_UNITS] if stage == "zero3" else []
    mistakes = [*(m for _, m in ratio_mistakes(2, "N")), *stale, SPREAD, ACCUMULATION, TENSOR_HOOK,
                *memory, *rest, *phases, *blocking, *extra, FROZEN_TRAINED, TIED_TWICE,
                STATE_DICT, LIVE_STATE_DICT, TAGS, NO_COMM, RANKS_DIFFER]
    return tuple(dict.fromkeys(mistakes))
