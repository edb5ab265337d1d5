"""Process set-up the plugin does in every SGLang process."""

from __future__ import annotations

import os
import shutil

from sglang_dart.plugin import put_ninja_on_path


def test_ninja_is_found_without_an_activated_virtualenv(monkeypatch):
    """SGLang's JIT builds (NGRAM's corpus) run `ninja` by name; a server started as .venv/bin/python
    without `activate` must still find the pinned one."""
    monkeypatch.setenv("PATH", "/usr/bin/nonexistent")
    assert shutil.which("ninja") is None
    put_ninja_on_path()
    found = shutil.which("ninja")
    assert found is not None and os.access(found, os.X_OK)
    put_ninja_on_path()  # idempotent: already found, PATH unchanged
    assert os.environ["PATH"].count(os.path.dirname(found)) == 1
