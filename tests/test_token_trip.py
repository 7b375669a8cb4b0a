"""benchmarks/token_trip.py's bookkeeping: what counts as carrying the step's state, and how a trip's
functions are named in docs/development.md's table (the trips themselves: run the tool)."""

import importlib.util
import sys
from pathlib import Path

import torch

PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "token_trip.py"
spec = importlib.util.spec_from_file_location("token_trip", PATH)
token_trip = sys.modules["token_trip"] = importlib.util.module_from_spec(spec)  # its dataclasses look it up
spec.loader.exec_module(token_trip)


class Job:
    pass


def test_a_container_carries_when_any_element_does():
    rec = token_trip.Recorder([Job])
    assert rec.carries(Job())
    assert rec.carries([1, 2, Job()])  # not only the first element
    assert rec.carries([(Job(), 4), (Job(), 2)])  # list[tuple[Job, int]], as the scheduler's take returns
    assert rec.carries({7: Job()}) and rec.carries((None, [Job()]))
    assert not rec.carries([1, (2, 3)]) and not rec.carries([]) and not rec.carries("Job")
    assert not rec.carries(torch.zeros(3)) and not rec.carries([[[Job()]]])  # two levels deep at most


def test_missing_carriers_are_skipped_and_named():
    found, missing = token_trip.carrier_types(["splitlm.no_such_module:Thing", "splitlm.transport.frames:Frame"])
    assert "splitlm.no_such_module:Thing" in missing
    assert all(isinstance(c, type) for c in found) and len(found) == len(set(found))


def test_the_table_names_a_class_once():
    names = ["Link.send", "decode", "Link.take", "Job.rows", "Link._receive"]
    assert token_trip.short_names(names) == ["Link.send", "take", "_receive", "decode", "Job.rows"]
    assert token_trip.layer("transport/messages.py") == "contract" and token_trip.layer("transport/crypto.py") == "wire"
    assert token_trip.layer("cloud/scheduler.py") == "cloud"
