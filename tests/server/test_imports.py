"""The server and the client library import neither torch nor the engine."""

from __future__ import annotations

import subprocess
import sys


def test_server_and_client_import_no_torch_and_no_engine() -> None:
    code = ("import sys; import hybridkv.server.server, hybridkv.connector.client, hybridkv.connector.layout; "
            "bad = [m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'hybridkv.engine'))]; "
            "print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"
