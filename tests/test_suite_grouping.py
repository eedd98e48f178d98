"""The suite's xdist scheduling (``tests/conftest.py``): a test file outside ``SPREAD`` runs
whole on one worker process, in its own order, so its module fixtures are built once. (Under
pytest 9 xdist's ``loadgroup`` silently made every test a group of its own.)"""

from __future__ import annotations

import os

import pytest

_RAN_HERE: list[str] = []  # this module's state in the process that runs it


def test_the_first_test_of_a_file() -> None:
    _RAN_HERE.append(os.environ.get("PYTEST_XDIST_WORKER", "serial"))


def test_the_next_test_of_the_file_runs_in_the_same_process(request) -> None:
    if not any(item.name == "test_the_first_test_of_a_file" for item in request.session.items):
        pytest.skip("the first test of this file was not selected")
    assert _RAN_HERE == [os.environ.get("PYTEST_XDIST_WORKER", "serial")], \
        f"this file's tests ran in different processes ({_RAN_HERE})"
