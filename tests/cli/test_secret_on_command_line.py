"""A secret given on the command line is visible to every user (`ps`): `hybridkv serve` warns."""

from __future__ import annotations

import subprocess
import sys


def test_serve_warns_about_an_api_key_on_the_command_line() -> None:
    # --max-body-bytes 0 makes it stop right after reading its options (exit 2), before loading a model
    out = subprocess.run([sys.executable, "-m", "hybridkv", "serve", "--api-key", "k" * 20, "--max-body-bytes", "0"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "warning: --api-key on the command line is visible to every user" in out.stderr
    assert "$HYBRIDKV_API_KEY" in out.stderr


def test_serve_takes_the_api_key_from_the_environment_without_a_warning() -> None:
    env = {"HYBRIDKV_API_KEY": "k" * 20, "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-m", "hybridkv", "serve", "--max-body-bytes", "0"], capture_output=True,
                         text=True, timeout=120, env=env)
    assert out.returncode == 2 and "--max-body-bytes must be at least 1" in out.stderr
    assert "warning" not in out.stderr
