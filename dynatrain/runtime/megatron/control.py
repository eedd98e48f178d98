"""When a running job switches: a schedule given at start, and requests posted from outside
(``requests.py``), both taken up at iteration boundaries.

``LiveControl.boundary(job)`` is called by every process of the job at every iteration
boundary. It

1. prepares a scheduled switch ``prepare_ahead`` iterations before it is due (planned and
   verified in the background while the job trains);
2. takes up at most one request from the store: rank 0 reads it and refuses at once what cannot
   run (a spec that does not parse, devices that are neither in the job nor waiting as spares,
   a switch already under way; for a preemption notice, a deadline already passed, devices not
   in the job, no layout on the rest), then tells every process the request's number (and a
   notice's milliseconds left) in one broadcast of three integers, so all of them act on the
   same request at the same boundary. For a notice, rank 0 picks the layout (the top of
   ``suggest`` on the devices that stay) in a thread of its own while the job trains on (at
   scale ``suggest`` plans several switches: seconds the job would otherwise stall), posts it
   and broadcasts the notice at the first boundary after the choice is made; every process
   prepares that one;
3. builds the destination job ahead (``LiveSwitcher.build_ahead``; a same-devices switch's,
   or one whose destination's world was made ahead: devices only leave, e.g. a notice's,
   or join, the joiners building with the job, while others may leave): a
   scheduled one's at a boundary before its iteration once every plan is ready, a requested
   one's at the first boundary where every process has its plan ready (an all-reduce of one
   flag), a notice's only while more than two iterations are left before its deadline;
4. switches when the switch is due: a scheduled one at its iteration, a requested one at the
   boundary after its destination was built ahead, or at the first where every plan is ready
   when it was not.

It returns the job to train on (``None`` on a process whose device left: it may idle as a spare
with ``LiveSwitcher.join``); ``last`` holds the last switch's result or failure. Rank 0 answers
each request: switched (exit 0), refused (2: the job never started it, e.g. a spec of another
model, refused by the planner) or failed (4: it started and was rolled back; the job trains on
in its previous layout). A notice's answer says whether the switch ended before the deadline.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from ...ir.errors import EXIT_BAD_INPUT, DynatrainError
from ...ir.layout import Layout
from ...ir.loader import spec_from_dict, spec_to_dict
from ...ir.spec import LayoutSpec
from ...report.summary import grid
from .job import MegatronJob, Notice, SwitchFailed, SwitchResult
from .job import first_line as _first_line
from .live import LiveSwitcher
from .rendezvous import CHECK_KEYS
from .requests import answer, read_request


@dataclass(frozen=True, slots=True)
class _Pending:
    spec: LayoutSpec
    due: int | None  # the scheduled iteration; None: a request, due once every plan is ready
    request: int | None  # the request's number in the store
    notice: Notice | None = None  # the preemption notice it meets


def _cause(err: SwitchFailed) -> BaseException:
    return err.__cause__ if err.__cause__ is not None else err


class LiveControl:
    """Decides, at each iteration boundary, whether and where the job switches.

    Args:
        switcher: this process's ``LiveSwitcher`` (running a rank of the job).
        schedule: iteration -> the layout to switch to at that boundary.
        requests: take up switches posted to the store (needs the switcher's rendezvous).
        prepare_ahead: plan a scheduled switch this many iterations before it is due.
        build_ahead: build a switch's destination job at a boundary before the switch
            (``LiveSwitcher.build_ahead``): a scheduled switch's once every process has its
            plan ready before its iteration; a request's at the first boundary where every
            plan is ready, the switch then at the next one (a notice's only if the time left
            is over two iterations).
    """

    def __init__(self, switcher: LiveSwitcher, *,
                 schedule: Mapping[int, LayoutSpec] | None = None, requests: bool = True,
                 prepare_ahead: int = 2, build_ahead: bool = True) -> None:
        if requests and switcher.rendezvous is None:
            raise DynatrainError("requests: taking switches from the store needs a rendezvous")
        self.sw, self.requests, self.ahead = switcher, requests, max(0, int(prepare_ahead))
        self.schedule = dict(schedule or {})
        self.pending: _Pending | None = None
        self.build_ahead = build_ahead
        self._tried = False  # the pending switch's destination: built ahead, or found it cannot
        self._waiting_since: float | None = None  # for the pending switch's world made ahead
        self._boundary: tuple[float, int] | None = None  # when the last boundary was, which
        self.iteration_seconds: float | None = None  # between the last two boundaries
        self.last: SwitchResult | SwitchFailed | None = None
        self._handled = 0  # the last request number rank 0 looked at
        # Rank 0: the notice whose layout is being chosen (number, notice, the choice, the
        # layout it is chosen from).
        self._choosing: tuple[int, dict, Future, LayoutSpec | None] | None = None
        self._chooser: ThreadPoolExecutor | None = None
        self._publish()

    def _publish(self) -> None:
        """Rank 0 posts the layout the job runs now under ``current`` (the spec document a
        request may start from: ``dynatrain switch`` targets the job's own model)."""
        sw = self.sw
        if self.requests and sw.leader:
            sw.rendezvous.post("current", {"spec": spec_to_dict(sw.spec, sw.layout.devices)})

    # ---- collectives of the job's group ------------------------------------------------------

    def _tensor(self, values: list[int]) -> torch.Tensor:
        t = torch.tensor(values, dtype=torch.int64)
        if dist.get_backend(self.sw.group) == "nccl":  # NCCL moves device memory only
            t = t.to(torch.device("cuda", torch.cuda.current_device()))
        return t

    def _from_leader(self, values: list[int]) -> list[int]:
        t = self._tensor(values)
        group = self.sw.group
        src = 0 if group is None else dist.get_global_rank(group, 0)
        dist.broadcast(t, src=src, group=group)
        return [int(v) for v in t.tolist()]

    def _everyone(self, flag: bool) -> bool:
        t = self._tensor([1 if flag else 0])
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.sw.group)
        return bool(int(t.item()))

    # ---- requests ----------------------------------------------------------------------------

    def _answer(self, n: int | None, outcome: str, line: str, leader: bool) -> None:
        if n is not None and leader:
            what = {"switched": "switched to", "refused": "refused:",
                    "failed": "failed and rolled back, the job trains on:"}[outcome]
            answer(self.sw.rendezvous.store, n, outcome, f"{what} {line}")

    def _look(self) -> tuple[int, int, int]:
        """Rank 0: the next request's number (0: none), whether the job takes it (1) and, for a
        notice, the milliseconds left before its deadline."""
        rdzv = self.sw.rendezvous
        if self._choosing is not None and self._choosing[2].done():
            n, notice, choice, spec = self._choosing
            self._choosing = None
            if not rdzv.has(f"answer/{n}"):  # (another rank 0 may have answered it meanwhile)
                try:
                    ms_left, refusal = self._chosen(n, notice, choice, spec)
                except Exception as err:  # noqa: BLE001 — answered; every rank goes on
                    ms_left, refusal = 0, f"notice: {type(err).__name__}: {_first_line(err)}"
                if refusal is not None:
                    answer(rdzv.store, n, "refused", f"refused: {refusal}")
                    return n, 0, 0
                rdzv.post(f"taken/{n}", {"notice": notice})
                return n, 1, ms_left
        # Requests answered already (e.g. before this process became rank 0) are passed over.
        while rdzv.count("requests") > self._handled and rdzv.has(f"answer/{self._handled + 1}"):
            self._handled += 1
        if rdzv.count("requests") <= self._handled:
            return 0, 0, 0
        self._handled += 1
        n = self._handled
        try:
            doc = read_request(rdzv.store, n)
            if doc is None:  # numbered, not yet written: look again at the next boundary
                self._handled -= 1
                return 0, 0, 0
            refusal = self._refusal(doc)
            if refusal is None and "notice" in doc:
                refusal = self._choose_for_notice(n, doc["notice"])
                if refusal is None:  # chosen in the background: taken up once it is made
                    return 0, 0, 0
        except DynatrainError as err:
            refusal = _first_line(err)
        except Exception as err:  # noqa: BLE001 — a request must never stop training
            refusal = f"request: {type(err).__name__}: {_first_line(err)}"
        if refusal is not None:
            answer(rdzv.store, n, "refused", f"refused: {refusal}")
            return n, 0, 0
        rdzv.post(f"taken/{n}", {"dst": doc["dst"]})
        return n, 1, 0

    @staticmethod
    def _seconds_left(notice: dict) -> float:
        return float(notice["deadline_unix"]) - time.time()

    def _choose_for_notice(self, n: int, notice: dict) -> str | None:
        """Rank 0: start choosing the layout that meets notice ``n`` (``check_notice``, in the
        background); None, or why the notice is refused at once."""
        leaving, when = notice.get("leaving"), notice.get("deadline_unix")
        if (not isinstance(leaving, list) or not all(isinstance(d, str) for d in leaving)
                or isinstance(when, bool) or not isinstance(when, (int, float))
                or not math.isfinite(when)):
            return ("request: notice: expected {'leaving': [device names], "
                    "'deadline_unix': seconds since the epoch, a finite number}")
        left = self._seconds_left(notice)
        if not left > 0:
            return (f"notice: the deadline passed {-left:.1f} s before the job took the "
                    "notice up (deadline_unix is on rank 0's clock)")
        if self._chooser is None:
            self._chooser = ThreadPoolExecutor(max_workers=1,
                                               thread_name_prefix="dynatrain-notice")
        self._choosing = (n, notice, self._chooser.submit(self.sw.check_notice, leaving, left),
                          self.sw.spec)
        return None

    def _chosen(self, n: int, notice: dict, choice: Future,
                spec: LayoutSpec | None) -> tuple[int, str | None]:
        """Rank 0: the choice for notice ``n`` made; post it as ``notice/<n>``. The
        milliseconds left and None, or 0 and why the notice is refused."""
        if self.pending is not None:  # a scheduled switch became due meanwhile
            return 0, self._refusal({})
        if self.sw.spec is not spec:
            return 0, ("notice: the job switched while a layout for the notice was being "
                       "chosen; notice again")
        try:
            met = choice.result()
        except DynatrainError as err:
            return 0, _first_line(err)
        except Exception as err:  # noqa: BLE001 — a bug in choosing must not stop training
            return 0, f"notice: choosing a layout failed ({type(err).__name__}: {err})"
        left = self._seconds_left(notice)
        if not left > 0:
            return 0, (f"notice: the deadline passed {-left:.1f} s before a layout on the "
                       "devices that stay was chosen")
        self.sw.rendezvous.post(f"notice/{n}", {
            "dst": spec_to_dict(met.dst_spec, Layout(met.dst_spec).devices),
            "predicted_s": met.predicted_seconds})
        return max(1, min(int(left * 1000), 1 << 62)), None  # an int64 in the broadcast

    def close(self) -> None:
        """Stop choosing (rank 0: a notice whose layout is still being chosen is answered as
        refused). Call when training ends."""
        if self._choosing is not None:
            n = self._choosing[0]
            self._choosing = None
            rdzv = self.sw.rendezvous
            if rdzv is not None and not rdzv.has(f"answer/{n}"):
                answer(rdzv.store, n, "refused", "refused: notice: the job ended before a "
                       "layout for it was chosen")
        if self._chooser is not None:
            self._chooser.shutdown(wait=False, cancel_futures=True)
            self._chooser = None

    def _refusal(self, doc: dict) -> str | None:
        """Why rank 0 refuses a request before any process plans it (None: it does not)."""
        if self.pending is not None:
            what = (f"request {self.pending.request}" if self.pending.request is not None
                    else f"the switch scheduled at iteration {self.pending.due}")
            return f"a switch is already under way ({what}); ask again when it is done"
        if self._choosing is not None:
            return (f"a switch is already under way (request {self._choosing[0]}: its layout "
                    "is being chosen); ask again when it is done")
        if isinstance(doc, dict) and "notice" in doc:
            return (None if isinstance(doc["notice"], dict) else
                    "request: notice: expected {'leaving': [...], 'deadline_unix': ...}")
        if not isinstance(doc, dict) or not isinstance(doc.get("dst"), dict):
            return "request: expected a document with a 'dst' layout spec"
        dst = Layout(spec_from_dict(doc["dst"]))
        here = set(self.sw.layout.devices)
        rdzv = self.sw.rendezvous
        missing: list[str] = []
        outside = [d for d in dst.devices if d not in here]
        # A look at the store per CHECK_KEYS devices outside the job, one by one only in a
        # batch where some are not spares, up to the first five such: a layout may name a
        # million devices, and the job waits for rank 0 at this boundary.
        for i in range(0, len(outside), CHECK_KEYS):
            batch = outside[i:i + CHECK_KEYS]
            if len(missing) > 4 or rdzv.has_all([f"spare/{d}" for d in batch]):
                continue
            for d in batch:
                if len(missing) <= 4 and not rdzv.has(f"spare/{d}"):
                    missing.append(d)
        if missing:
            more = " and more" if len(missing) > 4 else ""
            return (f"world: the layout needs {len(dst.devices)} devices; "
                    f"{', '.join(missing[:4])}{more} neither run(s) a rank of the job nor wait(s) "
                    "as a spare")
        return None

    # ---- the boundary ------------------------------------------------------------------------

    def boundary(self, job: MegatronJob) -> MegatronJob | None:
        """Call on every process of the job at every iteration boundary; the job to train on
        (None: this device left the job). With buddy copies (``LiveSwitcher(buddy=True)``) it
        takes this step's copy first, and the new layout's first copy right after a switch, so
        that a failure in the next iteration finds one."""
        if self.sw.buddy:
            self.sw.snapshot(job)
        if not self.due(job.iteration, job):
            return job
        new = self.switch(job)
        if new is not None and self.sw.buddy:
            self.sw.snapshot(new)
        return new

    def due(self, iteration: int, job: MegatronJob | None = None) -> bool:
        """Whether the job switches at the boundary before ``iteration`` (every process of
        the job calls it there, in step: it prepares switches and takes up requests). A
        training loop that cannot stop at every boundary (Megatron-LM's ``train``) calls it
        after each step and ends its segment when it says so, then calls ``switch``.
        ``job``: the job training now, given so that a build ahead also makes the exchange
        ahead (``LiveSwitcher.build_ahead``)."""
        now = time.monotonic()
        # Per iteration between boundaries seen (Megatron-LM's driver asks twice at a boundary
        # where a segment ends).
        if self._boundary is not None and iteration > self._boundary[1]:
            self.iteration_seconds = (now - self._boundary[0]) / (iteration - self._boundary[1])
        if self._boundary is None or iteration != self._boundary[1]:
            self._boundary = (now, iteration)
        if self.pending is None and (iteration + self.ahead) in self.schedule:
            due = iteration + self.ahead
            self._set_pending(_Pending(self.schedule.pop(due), due, None))
            self.sw.prepare(self.pending.spec)
        if self.requests:
            n, take, ms_left = self._from_leader(list(self._look()) if self.sw.leader
                                                 else [0, 0, 0])
            if n and take:
                self._take(n, ms_left)
        p = self.pending
        if p is None:
            return False
        if p.due is not None:
            if p.due <= iteration:
                return True
            # The last boundary before it builds whatever the joiners did (the build ahead
            # waits for them); earlier ones only once the world made ahead is ready.
            last = p.due == iteration + 1
            if self.build_ahead and not self._tried and self._everyone(
                    self.sw.ready() and (last or self._world_ready())):
                self._build(p, job)
            return False
        if not self._everyone(self.sw.ready()):
            return False
        if not self.build_ahead or self._tried:
            return True
        if p.notice is None and not self._everyone(self._world_ready()):
            return False  # trains on while the joiners make the destination's world; a
            # notice has a deadline (and its devices only leave): built now, as before
        # Built at this boundary: the switch runs at the next one.
        return not self._build(p, job)

    def _world_ready(self) -> bool:
        """Whether this process's part of the destination's world made ahead is settled (made
        or failed; none to make counts as settled): a join's needs its joiners, and the
        boundary does not wait for them, the job trains on. After ``timeout`` seconds of
        boundaries the build ahead runs anyway, waiting for them as it does."""
        if self._waiting_since is None:
            self._waiting_since = time.monotonic()
        return (self.sw.ahead_settled()
                or time.monotonic() - self._waiting_since > self.sw.timeout)

    def recovered(self, result: SwitchResult | None = None) -> None:
        """After ``LiveSwitcher.recover`` (``result``): the switch that was pending is dropped
        (its plan was of the old world), its request answered as failed with what happened
        instead (for a notice: whether its devices went before the switch, and how the job
        recovered), and rank 0 posts the layout the job runs now."""
        p = self.pending
        if p is not None and p.request is not None:
            info = result.recovery if result is not None else {}
            gone = ", ".join(info.get("failed", [])) or "a member of the job"
            if p.notice is not None:
                left = p.notice.seconds_left()
                when = (f"{-left:.1f} s after the notice's deadline" if left < 0 else
                        f"{left:.1f} s before the notice's deadline")
                head = f"notice: {gone} failed before the switch ran ({when})"
            else:
                head = f"{gone} failed before the switch ran"
            how = (f"; the job recovered by {info['mode']} on {len(info['devices'])} devices "
                   f"({info['dst']}) at iteration {info['iteration']}" if "mode" in info else
                   "; the job recovered on the devices left")
            self._answer(p.request, "failed", head + how, self.sw.leader)
        self._set_pending(None)
        if self.sw.active:
            self._publish()

    def _set_pending(self, p: _Pending | None) -> None:
        self.pending, self._tried, self._waiting_since = p, False, None

    def _build(self, p: _Pending, job: MegatronJob | None) -> bool:
        """Every process: build the pending switch's destination ahead, at this boundary;
        whether it was built (not for a notice whose time left is two iterations or less)."""
        self._tried = True
        if p.notice is not None:
            it = self.iteration_seconds
            if not self._everyone(it is not None and p.notice.seconds_left() > 2 * it):
                return False
        return self.sw.build_ahead(job) is None

    def _take(self, n: int, ms_left: int) -> None:
        """Every process: prepare request ``n`` (a notice: the layout rank 0 chose for it)."""
        rdzv = self.sw.rendezvous
        doc = rdzv.read(f"taken/{n}")  # as rank 0 accepted it, whatever request/<n> says now
        if "notice" not in doc:
            self._set_pending(_Pending(spec_from_dict(doc["dst"]), None, n))
            self.sw.prepare(self.pending.spec)
            return
        chosen = rdzv.read(f"notice/{n}")
        met = self.sw.notice(doc["notice"]["leaving"], ms_left / 1000.0,
                             dst_spec=spec_from_dict(chosen["dst"]))
        met = replace(met, predicted_seconds=chosen["predicted_s"])
        self._set_pending(_Pending(met.dst_spec, None, n, met))

    def switch(self, job: MegatronJob) -> MegatronJob | None:
        """Run the switch ``due`` said is due; the job to train on (None: this device left)."""
        p = self.pending
        if p is None:
            raise DynatrainError("switch(): no switch is due (call due() first)")
        it = job.iteration
        self._set_pending(None)
        leader = self.sw.leader  # of the source layout: it answers, whether it stays or not
        try:
            result = self.sw.switch(job)
        except SwitchFailed as err:
            self.last = err
            cause = _cause(err)
            # Refused: the input was (the planner or the job check said no on this process);
            # a failure elsewhere, or after anything moved, is a failed switch.
            bad_input = (not isinstance(cause, SwitchFailed) and isinstance(cause, DynatrainError)
                         and cause.exit_code == EXIT_BAD_INPUT)
            self._answer(p.request, "refused" if bad_input else "failed",
                         _first_line(cause) if bad_input else _first_line(err), leader)
            if err.job is None:
                raise
            return err.job
        self.last = result
        self._publish()
        seconds = result.seconds.get("downtime", 0.0)
        met = ""
        if p.notice is not None:
            left = p.notice.seconds_left()
            met = (f"; met the notice, {left:.1f} s before its deadline" if left >= 0 else
                   f"; ended {-left:.1f} s after the notice's deadline")
        # The layout's grid beside its name: a request built from the job's own spec keeps
        # the job's name, whatever layout it asks for.
        self._answer(p.request, "switched",
                     f"{p.spec.name} ({grid(Layout(p.spec))}) on {len(Layout(p.spec).devices)} "
                     f"devices at iteration {it} (downtime {seconds:.2f} s){met}", leader)
        return result.job
