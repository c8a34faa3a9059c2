"""run.json's ``hosts``: every process's host, rank 0's first; the liveness rule reads rank 0's."""

from __future__ import annotations

import os
import socket

import accelerate.utils

from trainer.runfolder.liveness import process_gone
from trainer.training import run_status


def test_hosts_gathered_from_every_rank_each_once_rank_zero_first(monkeypatch):
    ranks = ["node-b", "node-b", "node-a", "node-a", "node-c"]  # what gather_object returns, in rank order
    monkeypatch.setattr(accelerate.utils, "gather_object", lambda mine: ranks)
    assert run_status.run_hosts() == ["node-b", "node-a", "node-c"]


def test_one_process_lists_its_own_host():
    assert run_status.run_hosts() == [socket.gethostname()]


def test_a_dead_rank_zero_is_seen_on_its_own_host_only():
    gone = 2**22 + 12345  # above any pid_max Linux allows by default: no such process
    here, other = socket.gethostname(), "another-node"
    running = {"status": "running", "pid": gone}
    assert process_gone({**running, "hosts": [here]})
    assert process_gone({**running, "hosts": [here, other]})  # multi-node: rank 0 ran here
    assert not process_gone(
        {**running, "hosts": [other, here]}
    )  # rank 0 ran elsewhere: its pid means nothing
    assert not process_gone({**running, "hosts": [here], "pid": os.getpid()})
    assert not process_gone({**running, "hosts": []})
