"""``StreamBatches``: a rank's micro-batches read by DataLoader workers, on real shards on every store.

The same committed position gives the same micro-batches, holding the samples their ids name, with
0 or 3 workers (2 and 3 in the restart test); what workers read ahead and nobody trained is read again after a restart (at
another world size and another number of workers), so an epoch still trains every sample once.

Run:  .venv/bin/python -m pytest -q -p no:cacheprovider tests/test_stream_loader.py
"""

from __future__ import annotations

import json

import pytest
import torch

from elastic_trainer.stream import ParquetReader, ShardedSource, StreamBatches, StreamSampler, TokenFileReader
from elastic_trainer.stream.order import EpochOrder
from elastic_trainer.tasks import Task
from elastic_trainer.training.data import TokenRows
from elastic_trainer.training.feed import make_feed
from tests.helpers.stream_data import VOCAB, tokens_of, write_parquet_shards, write_token_files

CPU = torch.device("cpu")
ROWS = [23, 40, 9, 31]  # 103 rows, shards of uneven sizes


def id_and_tokens(row: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """A sample that carries its own id (to check what the workers delivered) and its tokens."""
    return torch.tensor(row["id"]), torch.from_numpy(row["tokens"].astype("int64"))


def feed(source, rank, world, workers, gbs=12, micro=2, state=None):
    sampler = StreamSampler(source.row_counts(), gbs, rank, world, seed=4, buffer=source.shuffle_buffer,
                            micro_batch_size=micro, data_digest=source.digest())
    if state is not None:
        sampler.load_state_dict(json.loads(json.dumps(state)))
    return sampler, StreamBatches(source, sampler, workers, None, CPU)


def one_step(sampler, batches) -> list[int]:
    """This rank's ids of one step, checked against the sampler and against the samples' content."""
    want = sampler.batch_ids()
    got = []
    for i in range(sampler.micro_batches_per_step):
        epoch, ids, (sample_ids, tokens) = batches.next(first_of_step=i == 0)
        assert epoch == sampler.epoch and sample_ids.tolist() == ids
        assert tokens.tolist() == [tokens_of(x, 4) for x in ids]
        got.append(ids)
    assert got == want
    return [x for mb in got for x in mb]


@pytest.mark.parametrize("workers", [0, 3])
def test_any_number_of_workers_delivers_the_micro_batches_the_sampler_names(any_url, workers):
    source = ShardedSource(write_parquet_shards(any_url, ROWS, row_group_size=6), ParquetReader(["id", "tokens"]),
                           transform=id_and_tokens, shuffle_buffer=10)
    sampler, batches = feed(source, rank=1, world=3, workers=workers)
    seen = []
    for _ in range(10):  # 8 steps in an epoch of 103 rows: across the roll into epoch 1
        seen.append((sampler.epoch, one_step(sampler, batches)))
        sampler.commit_step()
    assert [e for e, _ in seen] == [0] * 8 + [1] * 2
    assert len({x for e, ids in seen if e == 0 for x in ids}) == 8 * 4


def test_read_ahead_samples_are_read_again_after_a_restart_at_another_world_size_and_worker_count(tmp_path):
    """Three ranks with 2 workers each train 3 steps and start a 4th (their workers read further
    ahead); the job dies and comes back as 2 ranks with 3 workers, then 4 ranks with none. Every
    sample of the epoch is trained once: nothing read ahead counted, nothing skipped."""
    source = ShardedSource(write_parquet_shards(tmp_path, ROWS, row_group_size=6), ParquetReader(["id", "tokens"]),
                           transform=id_and_tokens, shuffle_buffer=10)
    trained, state = [], None
    for world, workers, steps in [(3, 2, 3), (2, 3, 2), (4, 0, 99)]:
        feeds = [feed(source, r, world, workers, state=state) for r in range(world)]
        for _ in range(steps):
            if feeds[0][0].epoch > 0:
                break
            for sampler, batches in feeds:
                trained += one_step(sampler, batches)
            for sampler, _ in feeds:
                sampler.commit_step()
        for sampler, batches in feeds:  # the next step's first micro-batch is fetched, never trained
            if sampler.epoch == 0:
                batches.next(first_of_step=True)
        state = feeds[0][0].state_dict()
    assert len(trained) == len(set(trained)) == (103 // 12) * 12
    assert sorted(trained) == sorted(EpochOrder(ROWS, 4, 0, 10).epoch_ids(0, 96).tolist())


@pytest.mark.parametrize("workers", [0, 2])
def test_a_joins_first_step_is_the_members_and_the_newcomer_pads_then_every_rank_reads_on(tmp_path, workers):
    """A live join (``StreamSampler.sit_out``): 2 ranks train 2 steps, a third joins and sits out the
    first step at 3. The members' feeds read exactly what they would have trained at 2; the newcomer's
    padding is a micro-batch of that step's samples that counts nowhere; then all 3 read their shares
    and the epoch trains every sample once."""
    source = ShardedSource(write_parquet_shards(tmp_path, ROWS, row_group_size=6), ParquetReader(["id", "tokens"]),
                           transform=id_and_tokens, shuffle_buffer=10)
    feeds, trained = [feed(source, r, 2, workers) for r in range(2)], []
    for _ in range(2):
        for sampler, batches in feeds:
            trained += one_step(sampler, batches)
        for sampler, _ in feeds:
            sampler.commit_step()
    state = feeds[0][0].state_dict()
    without_join = feed(source, 0, 2, 0, state=state)[0].global_batch()
    feeds = [feed(source, r, 3, workers, state=state) for r in range(3)]
    for sampler, _ in feeds:
        sampler.sit_out([2])
    assert [s.micro_batches_per_step for s, _ in feeds] == [3, 3, 0] and feeds[2][0].batch_ids() == []
    sample_ids, tokens = feeds[2][1].padding()
    assert len(sample_ids) == 2 and set(sample_ids.tolist()) <= set(without_join)
    assert tokens.tolist() == [tokens_of(x, 4) for x in sample_ids.tolist()]
    step = [x for sampler, batches in feeds[:2] for x in one_step(sampler, batches)]
    assert step == without_join, "the step the newcomer sat out is the one the members would have trained"
    trained += step
    for sampler, _ in feeds:
        sampler.commit_step()
    while feeds[0][0].epoch == 0:
        for sampler, batches in feeds:
            trained += one_step(sampler, batches)
        for sampler, _ in feeds:
            sampler.commit_step()
    assert len(trained) == len(set(trained)) == (103 // 12) * 12
    assert sorted(trained) == sorted(EpochOrder(ROWS, 4, 0, 10).epoch_ids(0, 96).tolist())


def test_token_files_feed_the_example_task_through_make_feed(tmp_path):
    urls = write_token_files(tmp_path, [30, 20], seq_len=4)
    source = ShardedSource(urls, TokenFileReader(4), transform=TokenRows(4, VOCAB, "reverse"), shuffle_buffer=8)
    task = Task(model=torch.nn.Linear(1, 1), dataset=source, loss_fn=lambda out, batch: out.sum())
    sampler, batches = make_feed(task, global_batch_size=10, rank=0, world_size=2, seed=4, micro_batch_size=None,
                                 num_workers=2, device=CPU)
    assert isinstance(batches, StreamBatches) and sampler.micro_sizes == [5]
    epoch, ids, (src, tgt) = batches.next(first_of_step=True)
    assert src.tolist() == [tokens_of(i, 4) for i in ids] and tgt.tolist() == [tokens_of(i, 4)[::-1] for i in ids]


def test_the_example_transform_refuses_short_rows_and_tokens_outside_the_vocabulary():
    import numpy as np

    with pytest.raises(ValueError, match="--src-len 4"):
        TokenRows(4, VOCAB)({"tokens": np.array([1, 2, 3])})
    with pytest.raises(ValueError, match="--vocab-size"):
        TokenRows(4, VOCAB)({"tokens": np.array([1, 2, 3, VOCAB])})
    with pytest.raises(ValueError, match="--vocab-size"):
        TokenRows(2, VOCAB)({"tokens": np.array([0, 5])})


@pytest.mark.parametrize("fmt", ["parquet", "tokens"])
def test_the_example_streams_what_write_shards_wrote_sequence_i_as_sample_id_i(tmp_path, fmt):
    from elastic_trainer.flags import parse_train_config
    from elastic_trainer.tasks import build_example, main
    from elastic_trainer.training.data import token_dataset

    flags = ["--dataset-size", "50", "--src-len", "6", "--vocab-size", "11", "--data-seed", "3"]
    assert main([f"write-{fmt}", str(tmp_path / "d"), "--shards", "3", "--row-group-size", "7", *flags]) == 0
    pattern = "*.parquet" if fmt == "parquet" else "*.bin"
    config = parse_train_config(["--data", f"{fmt}:{tmp_path / 'd'}/{pattern}", "--shuffle-buffer", "8", *flags])
    task = build_example(config.task_args)
    assert task.dataset.row_counts() == [17, 17, 16]
    sampler, batches = make_feed(task, global_batch_size=10, rank=1, world_size=2, seed=0, micro_batch_size=None,
                                 num_workers=0, device=CPU)
    memory = token_dataset(50, 6, 11, "reverse", 3)
    _, ids, (src, tgt) = batches.next(first_of_step=True)
    assert ids == sampler.batch_ids()[0]
    assert src.tolist() == [memory[i][0].tolist() for i in ids] and tgt.tolist() == [memory[i][1].tolist() for i in ids]


@pytest.mark.parametrize("flags, message", [
    (["--example", "seeds", "--data", "parquet:x/*.parquet"], "streams token sequences, for --example reverse or copy"),
    (["--data", "csv:x/*.csv"], "must be 'synthetic', 'h5:PATH'"),
    (["--data", "parquet:x/*.parquet", "--shuffle-buffer", "0"], "--shuffle-buffer 0 must be at least 1"),
])
def test_stream_flags_that_do_not_fit_the_example_are_refused_in_one_line(flags, message, capsys):
    from elastic_trainer.flags import parse_train_config

    with pytest.raises(SystemExit):
        parse_train_config(flags)
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
