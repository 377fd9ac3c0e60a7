"""Exactly-once: did the final model see every sample of the run once, and none twice?

Judged over the final lineage of a drill's logs (``drill_logs.final_lineage``: for each step
``1..final``, the world whose work the final model contains), from the sample ledger the trainer
writes with ``--sample-ledger`` (the dataset indices each rank consumed at each step):

* **repeated**: a dataset index consumed more than once in one epoch;
* **skipped**: a step missing from the lineage, a step with less than a full global batch, the
  sampler offset jumping forward between two steps, or (with the built-in sampler's order,
  :func:`sampler_order`, or a stream's, :func:`stream_order`) an index the sampler should have
  yielded at a step but did not.

With a streamed source (``--data parquet:...``) the ledger holds stable sample ids
(``stream.order``) instead of dataset indices. Which ids a step trains there depends on the world
sizes of the steps before it in the epoch (``stream.position``, invariant 3), so
:func:`stream_order` replays the stream sampler over the lineage's world sizes, step by step (a
step that a live join's newcomers sat out counts at the number of ranks that trained it:
``StreamSampler.sit_out`` deals it as a step of that world).

:func:`find_overlapping_worlds` finds two worlds training at the same time (a split brain).
"""

from __future__ import annotations

from collections import Counter

from elastic_trainer.drill.logs import Attempt, RunLogs, final_lineage


def check_exactly_once(logs: RunLogs, global_batch: int | None = None, expected=None) -> dict:
    """Judge exactly-once sample consumption over the final lineage (see the module docstring).

    ``expected(step, world_size) -> list[int]``, when given, is the global batch the sampler must
    yield at that step, at the world size that trained it (the ranks with samples in it: fewer than
    the world in the step a live join's newcomers sit out, ``sit_out``; the drill builds it from the trainer's
    dataset size or shards, and seed); it is called for the lineage's steps in increasing order.
    Every index it lists that the step did not consume counts as skipped.
    """
    lineage, missing, final = final_lineage(logs.attempts)
    have_ledger = any(w.ledger for w in logs.workers)
    result = {"final_step": final, "order_checked": expected is not None, "steps_checked": 0, "samples_checked": 0, "repeated": 0,
              "skipped": 0, "missing_steps": missing[:20], "missing_step_count": len(missing),
              "bad_batch_steps": [], "offset_gaps": [], "repeated_examples": [], "ledger": have_ledger}
    if not have_ledger:
        result["ok"] = False
        result["problem"] = "no sample ledger was written (run the trainer with --sample-ledger)"
        return result
    sizes: dict[int, int] = {}
    per_epoch: dict[int, Counter] = {}
    worlds: dict[str, dict[int, int]] = {}  # attempt -> step -> world size, from its rank-0 step log
    for step in range(1, final + 1):
        attempt = lineage.get(step)
        if attempt is None:
            continue
        rows = [row for w in attempt.workers for row in w.ledger if row.step == step]
        if not rows:
            missing.append(step)
            continue
        indices = [i for row in rows for i in row.indices]
        sizes[step] = len(indices)
        if expected is not None:
            world_of = worlds.setdefault(attempt.key, {s.step: s.world_size for s in attempt.rank0})
            # the ranks that trained it: fewer than the world in a step a live join's newcomers sat out
            # (they write no ledger line: ``sit_out``), which the sampler dealt as a step of their number
            world = min(world_of.get(step) or len(rows), len(rows))
            missed = set(expected(step, world)) - set(indices)
            if missed:
                result.setdefault("order_mismatch_steps", []).append(step)
                result["skipped"] += len(missed)
        per_epoch.setdefault(int(rows[0].epoch), Counter()).update(indices)
        result["steps_checked"] += 1
        result["samples_checked"] += len(indices)
    batch = global_batch or (Counter(sizes.values()).most_common(1)[0][0] if sizes else 0)
    result["global_batch"] = batch
    for step, size in sizes.items():
        if size != batch:
            result["bad_batch_steps"].append({"step": step, "samples": size})
            if size < batch:
                result["skipped"] += batch - size
    for epoch, counts in sorted(per_epoch.items()):
        for index, count in counts.items():
            if count > 1:
                result["repeated"] += count - 1
                if len(result["repeated_examples"]) < 10:
                    result["repeated_examples"].append({"epoch": epoch, "index": index, "times": count})
    # The sampler offset (samples of the epoch committed) must grow by exactly one batch a step.
    offsets = {}
    for step, attempt in lineage.items():
        rows = [s for s in attempt.rank0 if s.step == step]
        if rows and rows[0].offset is not None:
            offsets[step] = (rows[0].epoch or 0, rows[0].offset)
    for step in sorted(offsets):
        if step - 1 in offsets:
            (e0, o0), (e1, o1) = offsets[step - 1], offsets[step]
            gap = (o1 - o0 - batch) if e1 == e0 else (o1 - batch if e1 == e0 + 1 else 0)
            if gap > 0:
                result["offset_gaps"].append({"step": step, "skipped": gap})
                result["skipped"] += gap
    result["missing_steps"] = sorted(set(missing))[:20]
    result["missing_step_count"] = len(set(missing))
    result["skipped"] += len(set(missing)) * batch
    result["ok"] = result["repeated"] == 0 and result["skipped"] == 0 and not result["bad_batch_steps"]
    return result


def find_overlapping_worlds(attempts: list[Attempt], slack: float = 0.0) -> list[dict]:
    """Pairs of worlds of the run that both made optimizer steps at the same time (split brain)."""
    found = []
    for i, a in enumerate(attempts):
        for b in attempts[i + 1:]:
            if a.end > b.start + slack:
                found.append({"world_a": a.key, "world_b": b.key, "overlap_s": round(a.end - b.start, 3)})
    return found


def sampler_order(dataset_len: int, global_batch: int, seed: int):
    """``(step, world_size) -> global batch`` of the built-in ElasticSampler (shuffle on, constant
    global batch; the world size does not matter)."""
    from elastic_trainer.sampler import epoch_permutation

    per_epoch = dataset_len // global_batch
    cache: dict[int, list[int]] = {}

    def expected(step: int, world_size: int | None = None) -> list[int]:
        epoch, k = divmod(step - 1, per_epoch)
        if epoch not in cache:
            cache.clear()
            cache[epoch] = epoch_permutation(dataset_len, seed, epoch).tolist()
        return cache[epoch][k * global_batch:(k + 1) * global_batch]
    return expected


def stream_order(sizes: list[int], global_batch: int, seed: int, buffer: int, shuffle: bool = True):
    """``(step, world_size) -> global batch`` of the stream sampler over shards of ``sizes`` rows
    (constant global batch), replayed over the world sizes it is given.

    Steps must come in increasing order; a step skipped in between (missing from the lineage) is
    assumed to have run at the last world size. A world size that differs from the last one
    starts a new segment, exactly as the trainer's ``load_state_dict`` does after a re-form or a
    resume (and one that does not leaves the assignment as it is: ``stream.position``, invariant 3).
    """
    from elastic_trainer.stream.position import StreamSampler

    def sampler(world_size: int, state: dict | None = None) -> StreamSampler:
        made = StreamSampler(sizes, global_batch, 0, world_size, seed=seed, buffer=buffer, shuffle=shuffle)
        if state is not None:
            made.load_state_dict(state)
        return made

    replay = {"sampler": None, "step": 0}

    def expected(step: int, world_size: int) -> list[int]:
        if step <= replay["step"]:
            raise ValueError(f"stream_order replays steps in increasing order; step {step} came after {replay['step']}.")
        s = replay["sampler"] or sampler(world_size)
        for _ in range(step - 1 - replay["step"]):
            s.commit_step()
        if s.world_size != world_size:
            s = sampler(world_size, s.state_dict())
        batch = s.global_batch()
        s.commit_step()
        replay["sampler"], replay["step"] = s, step
        return batch
    return expected
