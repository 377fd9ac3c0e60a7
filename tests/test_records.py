"""The log records (``elastic_trainer.records``) and the drill's fault registry (``drill.kinds``):
each record round-trips to the same JSON line the trainer has always written, the readers read
what the trainer writes, unknown keys survive, a missing required key is an error that names the
file and line; every fault kind has its help, target rule, fire and (with a duration) heal."""

from __future__ import annotations

import json
import math

import pytest

from elastic_trainer import records
from elastic_trainer.drill import kinds
from elastic_trainer.drill.scenario import ScenarioError, build_parser, parse_fault
from elastic_trainer.records import Event, EventRecord, LedgerRecord, RecordError, StepRecord
from elastic_trainer.flags import parse_train_config
from elastic_trainer.training.trainer import Trainer

pytestmark = pytest.mark.timeout(120)

FIXTURE = "tests.helpers.task_fixture:build"

# Lines as the trainer wrote them before the records existed (compact JSON, these key orders).
OLD_STEP_LINES = [
    '{"time":1763980000.5,"step":1,"epoch":0,"offset":16,"world_size":2,"rank":1,"round":3,"restart":0,'
    '"loss":1.25,"node":"vm"}',
    '{"time":1763980001.5,"step":2,"epoch":0,"offset":32,"world_size":1,"rank":0,"round":null,"restart":2,'
    '"loss":0.5,"loss_scope":"rank","node":"vm"}',
]
OLD_EVENT_LINES = [
    '{"time":1.0,"event":"start","world_size":2,"restart":0,"round":3}',
    '{"time":2.0,"event":"checkpoint_loaded","step":5,"epoch":0,"offset":80,"world_size":1,"saved_world_size":2}',
    '{"time":2.1,"event":"resume","step":5,"world_size":1,"restart":1,"round":4}',
    '{"time":2.2,"event":"world_size_changed","old":2,"new":1,"step":5}',
    '{"time":3.0,"event":"checkpoint_saved","step":10,"blocked_s":0.01,"blocking":false,"committed":null,'
    '"epoch":0,"offset":160,"world_size":1}',
    '{"time":3.5,"event":"peer_state_loaded","step":11,"epoch":0,"offset":176,"world_size":2,"source":0,'
    '"seconds":0.2,"round":null}',
    '{"time":3.6,"event":"live_reform","step":11,"old":3,"new":2,"round":5,"old_round":4,"cause":"lost",'
    '"failed_at":3.1,"receivers":[1],"teardown_s":0.1,"agree_s":0.1,"group_s":0.1,"state_s":0.1,"total_s":0.4}',
    '{"time":3.7,"event":"live_excluded","step":11,"reason":"not in quorum 5"}',
    '{"time":4.0,"event":"stop","step":12,"reason":"signal SIGTERM"}',
    '{"time":4.5,"event":"stopped","step":12,"reason":"signal SIGTERM"}',
    '{"time":5.0,"event":"finished","step":20,"reason":"done"}',
]
OLD_LEDGER_LINES = ['{"step":1,"epoch":0,"round":null,"indices":[3,1,2]}',
                    '{"step":2,"epoch":1,"round":7,"indices":[]}']


def compact(record: records.Record) -> str:
    return json.dumps(record.to_json(), separators=(",", ":"))


@pytest.fixture(autouse=True)
def _single_process_env(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
                 "ELASTIC_TRAINER_CHECKPOINT_DIR", "ELASTIC_TRAINER_LOG_DIR", "ELASTIC_TRAINER_RDZV_ROUND"):
        monkeypatch.delenv(name, raising=False)


# ----------------------------------------------------------------------------- round trips

@pytest.mark.parametrize("cls, line", [(StepRecord, line) for line in OLD_STEP_LINES]
                         + [(EventRecord, line) for line in OLD_EVENT_LINES]
                         + [(LedgerRecord, line) for line in OLD_LEDGER_LINES])
def test_each_old_line_reads_and_writes_back_byte_for_byte(cls, line):
    record = cls.from_json(json.loads(line))
    assert compact(record) == line
    assert cls.from_json(record.to_json()) == record


def test_every_event_name_has_its_keys_and_reads_as_the_enum():
    assert set(records.EVENT_KEYS) == set(Event)
    for line in OLD_EVENT_LINES:
        record = EventRecord.from_json(json.loads(line))
        assert isinstance(record.event, Event) and record.event == json.loads(line)["event"]
    loaded = EventRecord.from_json(json.loads(OLD_EVENT_LINES[1]))
    assert (loaded.step, loaded.saved_world_size) == (5, 2)


def test_records_built_in_code_round_trip():
    step = StepRecord(time=1.0, step=3, epoch=0, offset=48, world_size=1, rank=0, round=None, restart=0,
                      loss=0.25, node="h")
    event = EventRecord(time=2.0, event=Event.CHECKPOINT_SAVED, step=3, blocked_s=0.1, blocking=True,
                        committed=True, epoch=0, offset=48, world_size=1)
    ledger = LedgerRecord(step=3, epoch=0, round=None, indices=[5, 6])
    for record in (step, event, ledger):
        assert type(record).from_json(json.loads(compact(record))) == record
    assert "loss_scope" not in step.to_json()  # written only when set


def test_unknown_keys_and_event_names_are_kept():
    step = StepRecord.from_json({"time": 1.0, "step": 1, "world_size": 1, "rank": 0, "tokens_per_s": 9.5})
    assert step.extra == {"tokens_per_s": 9.5} and step.to_json()["tokens_per_s"] == 9.5
    future = EventRecord.from_json({"time": 1.0, "event": "quorum_changed", "step": 4, "members": [0, 2]})
    assert future.event == "quorum_changed" and not isinstance(future.event, Event)
    assert future.to_json() == {"time": 1.0, "event": "quorum_changed", "step": 4, "members": [0, 2]}
    ledger = LedgerRecord.from_json({"step": 1, "epoch": 0, "indices": [1], "digest": "ab"})
    assert ledger.round is None and ledger.extra == {"digest": "ab"}


@pytest.mark.parametrize("cls, obj, missing", [
    (StepRecord, {"time": 1.0, "rank": 0}, "step"),
    (EventRecord, {"time": 1.0, "step": 3}, "event"),
    (LedgerRecord, {"step": 1, "epoch": 0}, "indices"),
])
def test_a_missing_required_key_is_an_error_naming_the_file_and_line(tmp_path, cls, obj, missing):
    path = tmp_path / "log.jsonl"
    good = {StepRecord: OLD_STEP_LINES[0], EventRecord: OLD_EVENT_LINES[0], LedgerRecord: OLD_LEDGER_LINES[0]}[cls]
    path.write_text(good + "\n\n" + json.dumps(obj) + "\n")
    with pytest.raises(RecordError, match=rf"{path}:3: a \w+ record needs the key\(s\) {missing}"):
        records.read_file(path, cls)


def test_a_required_number_that_is_not_one_is_an_error():
    with pytest.raises(RecordError, match="'time' must be a number"):
        StepRecord.from_json({"time": "noon", "step": 1})


def test_a_torn_last_line_and_a_missing_file_read_as_nothing(tmp_path):
    path = records.steps_path(tmp_path, 0, 42)
    path.parent.mkdir(parents=True)
    path.write_text(OLD_STEP_LINES[0] + "\n" + OLD_STEP_LINES[1][:40])
    assert [s.step for s in records.read_steps(tmp_path)] == [1]
    assert records.read_events(tmp_path / "nowhere") == [] and records.read_ledger(tmp_path) == []


def test_file_names_and_finding_worker_files(tmp_path):
    assert records.steps_path(tmp_path, 1, 77) == tmp_path / "steps" / "rank-1-77.jsonl"
    assert records.ledger_path(tmp_path, 0, 5) == tmp_path / "ledger" / "rank-0-5.jsonl"
    assert records.events_path(tmp_path) == tmp_path / "events.jsonl"
    for rank, pid in ((0, 10), (1, 11), (10, 12)):
        log = records.JsonLines(records.steps_path(tmp_path, rank, pid))
        log.write(StepRecord(time=float(pid), step=1, world_size=11, rank=rank))
        log.close()
    (tmp_path / "steps" / "notes.jsonl").write_text("{}\n")  # not a worker file: ignored
    assert [(f.rank, f.pid) for f in records.step_files(tmp_path)] == [(0, 10), (1, 11), (10, 12)]
    assert [(f.rank, f.pid) for f in records.step_files(tmp_path, rank=1)] == [(1, 11)]  # not rank 10
    assert [s.origin for s in records.read_steps(tmp_path, rank=0, origin="node-3")] == ["node-3"]


# ----------------------------------------------------------------------------- the trainer writes them

def test_the_readers_read_what_the_trainer_writes(tmp_path):
    logs, ck = tmp_path / "logs", tmp_path / "ck"
    common = ["--task", FIXTURE, "--global-batch-size", "16", "--micro-batch-size", "8", "--sample-ledger",
              "--log-dir", str(logs), "--checkpoint-dir", str(ck), "--no-wandb", "--no-progress"]
    Trainer(parse_train_config([*common, "--max-steps", "3"])).train()
    Trainer(parse_train_config([*common, "--max-steps", "5"])).train()  # resumes at step 3

    steps = records.read_steps(logs, rank=0)
    assert [s.step for s in steps] == [1, 2, 3, 4, 5]
    assert all(s.world_size == 1 and s.rank == 0 and s.epoch == 0 and math.isfinite(s.loss) for s in steps)
    assert [s.offset for s in steps] == [16, 32, 48, 64, 80] and not any(s.extra for s in steps)
    ledger = records.read_ledger(logs)
    assert [r.step for r in ledger] == [1, 2, 3, 4, 5] and all(len(r.indices) == 16 for r in ledger)
    events = records.read_events(logs)
    names = [e.event for e in events]
    assert names[0] == Event.START and names[-1] == Event.FINISHED and events[-1].step == 5
    assert names.index(Event.CHECKPOINT_LOADED) < names.index(Event.RESUME)
    assert next(e for e in events if e.event == Event.RESUME).step == 3
    assert all(isinstance(n, Event) for n in names)

    # every line on disk is exactly what its record writes back (the format is one definition)
    for f, cls in [(f, StepRecord) for f in records.step_files(logs)] + \
                  [(f, LedgerRecord) for f in records.ledger_files(logs)]:
        for line in f.path.read_text().splitlines():
            assert compact(cls.from_json(json.loads(line))) == line
    for line in records.events_path(logs).read_text().splitlines():
        assert compact(EventRecord.from_json(json.loads(line))) == line


# ----------------------------------------------------------------------------- fault registry

@pytest.mark.parametrize("name", list(kinds.FAULTS))
def test_every_fault_kind_has_help_a_target_rule_fire_and_heal_with_a_duration(name):
    kind = kinds.FAULTS[name]
    assert kind.name == name and kind.help.strip()
    assert isinstance(kind.target, kinds.Target) and callable(kind.fire)
    assert (kind.heal is not None) == (kind.duration is not None), "a fault with a duration is healed"
    assert (kind.default_target is not None) == (kind.target is kinds.Target.OPTIONAL)
    assert kind.victim in (None, "target", "rank0")
    assert kind.victim != "target" or kind.target is not kinds.Target.NONE


@pytest.mark.parametrize("name", list(kinds.FAULTS))
def test_the_grammar_and_help_follow_the_registry(name):
    kind = kinds.FAULTS[name]
    assert f"--{name}" in build_parser().format_help()
    target = "node:1" if kind.target is kinds.Target.REQUIRED else ""
    [fault] = parse_fault(name, f"{target}@step:5")
    assert fault.duration == kind.duration
    assert fault.target == (target or kind.default_target)
    if kind.target is kinds.Target.NONE:
        with pytest.raises(ScenarioError, match="takes no target"):
            parse_fault(name, "node:1@step:5")
    if kind.duration is None:
        with pytest.raises(ScenarioError, match="takes no for"):
            parse_fault(name, f"{target}@step:5,for:3")
    else:
        assert parse_fault(name, f"{target}@step:5,for:3")[0].duration == 3.0
