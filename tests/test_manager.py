"""The Manager's public API outside a live run, the typed worker environment, and how the
launcher chooses live recovery for a user's own script (the live path itself, with real agents,
etcd and SIGKILLs, is tests/test_live_recovery.py)."""

from __future__ import annotations

import pytest

from elastic_trainer.cli import launch
from elastic_trainer.env import ENV_LIVE, LiveSettings, WorkerEnv
from elastic_trainer.rendezvous.options import RendezvousOptions
from elastic_trainer.training.manager import Manager, script_uses_manager
from tests.helpers.common import REPO


def test_worker_env_round_trips_through_the_environment_and_ignores_what_is_not_a_number():
    env = WorkerEnv(rank=1, world_size=4, local_rank=1, local_world_size=2, restart_count=3, rdzv_round=0,
                    rdzv_prefix="/p/run/", rdzv_node="host_1_2", rdzv_conn='{"endpoints": "e:1"}',
                    rdzv_endpoint="e:1", live=LiveSettings(min_nodes=2, max_nodes=3, report_timeout=2.0))
    environ = env.to_environ()
    assert environ["RANK"] == "1" and environ["ELASTIC_TRAINER_RDZV_ROUND"] == "0"
    assert WorkerEnv.from_environ(environ) == env
    assert WorkerEnv.from_environ({"RANK": "x", "WORLD_SIZE": ""}) == WorkerEnv()
    assert not WorkerEnv.from_environ({"RANK": "0"}).launched
    assert WorkerEnv.from_environ({ENV_LIVE: '{"min_nodes": 2, "from_a_newer_version": 1}'}).live == \
        LiveSettings(min_nodes=2)
    with pytest.raises(ValueError, match=ENV_LIVE):
        WorkerEnv.from_environ({ENV_LIVE: "{not json"})


def test_the_live_settings_defaults_are_the_rendezvous_options_defaults():
    d, live = RendezvousOptions.DEFAULTS, LiveSettings()
    assert (d["join_timeout"], d["last_call_timeout"], d["report_timeout"], d["lease_ttl"],
            d["keep_alive_interval"]) == (live.join_timeout, live.last_call, live.report_timeout, live.lease_ttl,
                                          live.keep_alive_interval)


def test_a_manager_outside_a_live_run_is_plain_agrees_alone_and_never_reforms():
    """Not launched (no torchrun environment): no group, no quorum; the agreement is the loop's own
    values; a failure is not recovered (``run`` re-raises) and ``reform`` says why it cannot."""
    manager = Manager(env=WorkerEnv())
    manager.start()
    assert not manager.live and not manager.distributed and not manager.newcomer
    assert manager.receive_state() is None and manager.fence is None
    manager.before_step()
    assert manager.run(lambda: 7) == (7, None)  # run counts the step
    assert manager.agree_due() and manager.agree_due()  # the first step agrees; asking twice changes nothing
    agreed = manager.agree([1.5, 2.0], interval=3)
    assert agreed.values == [1.5, 2.0] and not agreed.reform and agreed.next_in == 3
    due = []
    for _ in range(3):
        manager.run(lambda: None)
        due.append(manager.agree_due())
    assert due == [False, False, True]
    with pytest.raises(RuntimeError, match="gloo"):
        manager.run(lambda: (_ for _ in ()).throw(RuntimeError("gloo: connection closed by peer")))
    with pytest.raises(RuntimeError, match="needs live recovery"):
        manager.reform(0, "test")
    manager.close()


def test_the_launcher_runs_a_script_live_only_when_it_uses_the_manager(tmp_path):
    """A script that uses ``elastic_trainer.Manager`` runs live by default; another one gets the
    restart path, and ``--recovery live`` for it is refused with a sentence that says why (under
    live mode torchrun would give it a process group of its own node only)."""
    own_loop = REPO / "examples" / "own_loop.py"
    plain = tmp_path / "plain.py"
    plain.write_text("import torch.distributed as dist\ndist.init_process_group()\n")
    assert script_uses_manager(str(own_loop)) and not script_uses_manager(str(plain))
    assert not script_uses_manager(str(tmp_path / "missing.py"))
    mentions = tmp_path / "mentions.py"
    mentions.write_text('"""Not elastic_trainer\'s Manager: a CheckpointManager."""\nimport elastic_trainer\n')
    assert not script_uses_manager(str(mentions)), "a mention is not a use"
    for use in ("from elastic_trainer import (\n    Manager,\n    records,\n)\n",
                "import elastic_trainer\nm = elastic_trainer.Manager()\n",
                "from elastic_trainer.training.manager import Agreement, Manager\n"):
        (tmp_path / "use.py").write_text(use)
        assert script_uses_manager(str(tmp_path / "use.py")), use
    assert script_uses_manager("elastic_trainer.train", module=False) is False
    assert launch.parse_run_config([str(own_loop)]).rdzv_conf["recovery"] == "live"
    assert launch.parse_run_config([str(plain)]).rdzv_conf["recovery"] == "restart"
    with pytest.raises(launch.UsageError, match="process group of its own node"):
        launch.parse_run_config(["--recovery", "live", str(plain)])
