"""The per-step phase profile (SGLANG_DART_PROFILE=1): phases are averaged per batch size, and the rest of
the interval between consecutive decode steps is reported as "outside"."""

from __future__ import annotations

import time

from sglang_dart.dart.phase_timer import OUTSIDE, PhaseTimer


def test_disabled_timer_records_nothing():
    timer = PhaseTimer(enabled=False, every=1)
    with timer.phase("verify"):
        pass
    timer.step_done(4)
    assert timer.report() == ""


def test_phases_are_averaged_per_batch_size():
    timer = PhaseTimer(enabled=True, every=100)
    for bs, seconds in [(16, 0.004), (16, 0.002), (1, 0.001)]:
        with timer.phase("verify"):
            time.sleep(seconds)
        timer.step_done(bs)
    report = timer.report()
    assert report.startswith("bs 16 x2: verify ")
    assert "; bs 1 x1: verify " in report
    mean_16 = float(report.split("bs 16 x2: verify ")[1].split(",")[0].split(";")[0])
    assert 3.0 <= mean_16 < 50.0  # ms: the mean of 4 and 2 ms sleeps, with scheduling slack


def test_outside_counts_the_gap_between_steps_but_not_across_a_prefill():
    timer = PhaseTimer(enabled=True, every=100)
    timer.step_done(2)  # the first step has no previous end: no outside time yet
    assert OUTSIDE not in timer.report()
    time.sleep(0.005)
    timer.step_done(2)
    gap_ms = float(timer.report().split(f"{OUTSIDE} ")[1])
    assert gap_ms >= 2.0  # 5 ms over two steps
    timer.interrupt()  # a prefill ran: the next gap is not a decode step's
    time.sleep(0.05)
    timer.step_done(2)
    assert float(timer.report().split(f"{OUTSIDE} ")[1]) < 25.0  # 50 ms not counted (mean over 3)


def test_report_resets_after_logging(caplog):
    timer = PhaseTimer(enabled=True, every=2)
    with caplog.at_level("INFO"):
        timer.step_done(3)
        timer.step_done(3)
    assert any("DART step profile" in r.message and "bs 3 x2" in r.message for r in caplog.records)
    assert timer.report() == ""


def test_phases_before_a_step_starts_are_not_its_own():
    timer = PhaseTimer(enabled=True, every=100)
    with timer.phase("draft"):  # a prefill's draft forward
        time.sleep(0.01)
    timer.step_start()
    with timer.phase("verify"):
        pass
    timer.step_done(1)
    assert "draft" not in timer.report()


def test_prefills_are_reported_apart_with_their_draft_share():
    timer = PhaseTimer(enabled=True, every=100)
    timer.interrupt()  # a prefill starts
    with timer.phase("draft"):
        time.sleep(0.002)
    timer.prefill_done(0.010)
    timer.step_start()
    with timer.phase("verify"):
        pass
    timer.step_done(1)
    report = timer.report()
    assert "draft" not in report.split("prefill")[0]  # the prefill's draft is not the step's
    prefill = report.split("prefill x1: ")[1]
    assert float(prefill.split(" ")[0]) == 10.0
    assert float(prefill.split("draft ")[1].rstrip(")")) >= 2.0


def test_cprofile_covers_the_chosen_steps_and_is_written_once(tmp_path, monkeypatch):
    import pstats

    path = tmp_path / "dart-{pid}.prof"
    monkeypatch.setenv("SGLANG_DART_CPROFILE", str(path))
    monkeypatch.setenv("SGLANG_DART_CPROFILE_START", "2")
    monkeypatch.setenv("SGLANG_DART_CPROFILE_STEPS", "3")
    timer = PhaseTimer(enabled=False)

    def marker_in_profiled_steps() -> None:
        time.sleep(0.001)

    for _ in range(8):
        marker_in_profiled_steps()
        timer.step_done(1)
    files = list(tmp_path.iterdir())
    assert len(files) == 1 and files[0].name.startswith("dart-") and "{pid}" not in files[0].name
    stats = pstats.Stats(str(files[0]))
    calls = {fn[2]: v[0] for fn, v in stats.stats.items()}
    assert calls.get("marker_in_profiled_steps") == 3  # the 3 steps after the first 2


def test_cprofile_to_an_unwritable_path_is_logged_not_raised(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("SGLANG_DART_CPROFILE", str(tmp_path / "missing-dir" / "dart.prof"))
    monkeypatch.setenv("SGLANG_DART_CPROFILE_START", "1")
    monkeypatch.setenv("SGLANG_DART_CPROFILE_STEPS", "1")
    timer = PhaseTimer(enabled=False)
    for _ in range(3):
        timer.step_done(1)  # the step that writes the profile must not raise
    assert "SGLANG_DART_CPROFILE: no profile" in caplog.text
