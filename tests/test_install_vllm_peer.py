"""scripts/install_vllm_peer.py (`make vllm-peer`): a step that fails ends the script with one line
naming the step and its exit code (the step's own output says why), never a traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest
from scripts import install_vllm_peer


def test_a_failed_step_ends_with_a_line_naming_it(monkeypatch):
    def fails(cmd, env=None):
        return subprocess.CompletedProcess(cmd, 3)

    monkeypatch.setattr(install_vllm_peer.subprocess, "run", fails)
    with pytest.raises(SystemExit) as ended:
        install_vllm_peer.run(sys.executable, "-m", "specdec.vllm_peer", "convert", "no-such-model")
    message = str(ended.value.code)
    assert "exit code 3" in message and "specdec.vllm_peer convert no-such-model" in message
    assert "\n" not in message


def test_a_step_that_succeeds_returns(monkeypatch):
    ran = []

    def succeeds(cmd, env=None):
        ran.append(cmd)
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(install_vllm_peer.subprocess, "run", succeeds)
    install_vllm_peer.run("true")
    assert ran == [("true",)]
