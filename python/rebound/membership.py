"""Membership of a Python worker: registration, heartbeats in a background thread, the
server's commands (STOP, DRAIN, PREEMPT_AUDIT) and takeovers, and fencing
(docs/protocol.md#identity-and-fencing).

A fenced worker (FAILED_PRECONDITION for its current incarnation) exits at once with code 3 from
the thread that learns it (``os._exit``: no later write can leave the process). The other ends a
background thread learns, a refused heartbeat (UNAUTHENTICATED, PERMISSION_DENIED: 5), a server
that forgot the worker (ABORTED) or had no acknowledged heartbeat for give_up_after_s (4), a
step-log batch refused as invalid (1, rebound.steplog), go through ``end``: with
``exit_at_once`` the process exits with the code; without (``run(..., exit=False)``) the session
records it (``ended``) and stops, and the work thread returns it. ``deregister`` first marks the
session as leaving, so that the refusals that follow a clean exit are not taken for a fencing.

The session (docs/design.md §13, crash detection): from ``start`` until ``deregister`` (after its
call) or ``join``, a third thread holds one WorkerSession.Attach call open under the current
incarnation, and attaches again at once whenever it ends (the server ended it, a connection
reset, a leader change) or the incarnation changes (``adopt``). A process that dies closes its
connection, and the server declares it failed within crash_confirm_ms instead of after
failure_timeout_ms of missed heartbeats.

Audits (docs/recovery.md#audits): a session made with ``audits=True`` registers as able to run
audit tasks. The spare calls ``begin_audit`` when it starts replaying one and ``end_audit`` when
it is over; in between, a heartbeat's PREEMPT_AUDIT (a slot lost its trainer and needs this
spare) makes ``audit_preempted()`` true. Outside an audit the command is ignored, and
``begin_audit`` clears what an earlier audit's command left, so that a stale PREEMPT_AUDIT never
cancels the next audit.

Thread-safety: the registration, progress and flags are read and written under ``lock``;
``changed`` is notified when the registration changes (a takeover).
"""

import os
import threading
import time

import grpc

import rebound
from rebound import client as rclient
from rebound_pb import config_pb2, rebound_pb2, rebound_pb2_grpc

_log = rclient.log
_Exit = rclient.WorkerExit



# How often a trainer held by the start barrier heartbeats (seconds).
START_BARRIER_BEAT_S = 0.05
# The session's attach retries: the first after this many seconds, doubling up to
# SESSION_RETRY_MAX_S; every Attach call's deadline (the server ends a session after 10 minutes).
SESSION_FIRST_RETRY_S = 0.01
SESSION_RETRY_MAX_S = 1.0
SESSION_DEADLINE_S = 1800.0


class Session:

    def __init__(self, conn, options, spec_model, name, role, job_id, exit_at_once=True,
                 audits=False):
        self.conn = conn
        self.options = options
        self.name = name
        self.requested_role = role
        self.job_id = job_id
        self._model_bundle = spec_model
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self.stop = threading.Event()       # the work must end (STOP, a signal, max_seconds)
        self.job_done = False
        self.drain = False
        # The job's start barrier (TopologyConfig.min_trainers) holds this trainer: from the
        # registration's and then the heartbeats' hold_start (wait_for_start).
        self.start_held = False
        self.registration = None            # RegisterResponse (incarnation, role, slot, job)
        self.step = 0
        self.loss = float("nan")
        self.log_pending = 0
        self.leaving = False  # deregistering: the server's refusals that follow are expected
        self.audits = audits  # RegisterRequest.audits: this worker's spare loop runs audits
        self._auditing = False        # between begin_audit and end_audit
        self._audit_preempted = False  # PREEMPT_AUDIT while _auditing
        self.exit_at_once = exit_at_once
        self.ended = None     # (code, reason) when a background thread ended the work (``end``)
        self._thread = None
        # The session's thread, its end, its wake-up (a new incarnation) and its open call.
        self._session_thread = None
        self._session_end = threading.Event()
        self._session_wake = threading.Event()
        self._session_call = None
        self.attaches = 0  # sessions the server accepted

    def register(self):
        request = rebound_pb2.RegisterRequest(
            job_id=self.job_id, worker_name=self.name, requested_role=self.requested_role,
            backend=config_pb2.CPU, model=self._model_bundle, version=rebound.__version__,
            audits=self.audits)
        try:
            response = self.conn.call("Register", request, stop=self.stop)
        except rclient.CallError as error:
            raise _Exit(rebound.EXIT_REJECTED, "registration refused: %s" % error) from None
        # The server applies the same rule; this catches a server from before it did (0.12).
        refused = rebound.incompatible_server(response.server_version)
        if refused:
            raise _Exit(rebound.EXIT_REJECTED, "registration refused: %s" % refused)
        self.conn.set_credential(response.credential)
        with self.lock:
            self.registration = response
            self.step = response.start_step
            self.start_held = response.hold_start
            self.changed.notify_all()
        slot = response.slot
        _log("registered '%s' as %s incarnation %d%s" % (
            self.name, config_pb2.WorkerRole.Name(response.role), response.incarnation,
            " slot (%d, %d)" % (slot.replica, slot.stage) if response.HasField("slot") else ""))
        return response

    def current(self):
        with self.lock:
            return self.registration

    def adopt(self, registration):
        """A takeover: this worker is now the slot's trainer under a new incarnation."""
        with self.lock:
            self.registration = registration
            self.step = registration.start_step
            self.start_held = False  # a slot taken over belongs to a job that has started
            self.changed.notify_all()
        self._reattach()

    def begin_audit(self):
        """The spare starts replaying an audit: from now a PREEMPT_AUDIT stops it (and one left
        from an earlier audit does not)."""
        with self.lock:
            self._auditing = True
            self._audit_preempted = False

    def end_audit(self):
        with self.lock:
            self._auditing = False
            self._audit_preempted = False

    def audit_preempted(self):
        """Whether the server asked (PREEMPT_AUDIT) to stop the audit in progress."""
        with self.lock:
            return self._audit_preempted

    def set_progress(self, step, loss):
        with self.lock:
            self.step = step
            self.loss = loss

    def start(self):
        self._thread = threading.Thread(target=self._beat, name="rebound-heartbeat", daemon=True)
        self._thread.start()
        self._session_thread = threading.Thread(target=self._hold_session,
                                                name="rebound-session", daemon=True)
        self._session_thread.start()

    def _reattach(self):
        """The incarnation changed: the session attaches again under the new one."""
        with self.lock:
            call = self._session_call
            self._session_wake.set()
        if call is not None:
            call.cancel()

    def _end_session(self):
        with self.lock:
            call = self._session_call
            self._session_end.set()
            self._session_wake.set()
        if call is not None:
            call.cancel()

    def _hold_session(self):
        stub = rebound_pb2_grpc.WorkerSessionStub(self.conn.channel)
        backoff = SESSION_FIRST_RETRY_S
        refused = 0
        while not self._session_end.is_set():
            self._session_wake.clear()
            incarnation = self.current().incarnation
            call = stub.Attach(rebound_pb2.AttachRequest(incarnation=incarnation),
                               timeout=SESSION_DEADLINE_S, metadata=self.conn.metadata())
            with self.lock:
                if self._session_end.is_set() or self._session_wake.is_set():
                    call.cancel()  # ended, or the incarnation changed since it was read
                self._session_call = call
            attached = False
            code = None
            try:
                for event in call:
                    if event.attached and not attached:
                        attached = True
                        self.attaches += 1
                        backoff = SESSION_FIRST_RETRY_S
                        refused = 0
            except grpc.RpcError as error:
                code = error.code()
            finally:
                with self.lock:
                    self._session_call = None
            if self._session_end.is_set():
                return
            # Attached and ended: attach again at once, within the server's crash_confirm_ms.
            if attached:
                continue
            if code == grpc.StatusCode.UNIMPLEMENTED:
                _log("the server has no worker sessions (an older server, before 0.13): its "
                     "failure detection is the heartbeat timeout alone")
                return
            if code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED) and \
                    refused != incarnation:
                # Fenced, unknown or refused: the heartbeat thread learns it and acts.
                _log("session of incarnation %d refused: %s" % (incarnation, code))
                refused = incarnation
            self._session_wake.wait(backoff)
            backoff = min(2 * backoff, SESSION_RETRY_MAX_S)

    def end(self, code, reason):
        """A background thread cannot go on (codes 1, 4, 5; never 3: ``fenced``): ends the
        process with ``code`` (``exit_at_once``), or records (code, reason) in ``ended`` and
        sets ``stop``, so that the work ends after its current step and returns the code."""
        _log(reason)
        if self.exit_at_once:
            os._exit(code)
        with self.lock:
            if self.ended is None:
                self.ended = (code, reason)
        self.stop.set()

    def join(self, timeout):
        """Waits up to ``timeout`` seconds for the heartbeat thread to end (after ``stop``); ends
        the session."""
        self._end_session()
        if self._thread is not None:
            self._thread.join(timeout=timeout)
        if self._session_thread is not None:
            self._session_thread.join(timeout=timeout)

    def fenced(self, reason):
        if self.leaving:
            return
        _log("fenced by the server, exiting: %s" % reason)
        os._exit(rebound.EXIT_FENCED)

    def _beat(self):
        backoff = rclient.Backoff(self.options.backoff_initial_s, self.options.backoff_max_s)
        last_contact = time.monotonic()
        while not self.stop.is_set():
            current = self.current()
            job = current.job
            interval = job.fault_tolerance.heartbeat_interval_ms / 1000.0
            with self.lock:
                request = rebound_pb2.HeartbeatRequest(
                    incarnation=current.incarnation, step=self.step, loss=self.loss,
                    log_bytes_pending=self.log_pending)
            try:
                response = self.conn.stub.Heartbeat(
                    request, timeout=self.options.rpc_deadline_s, metadata=self.conn.metadata())
            except Exception as error:  # grpc.RpcError
                if self.leaving:
                    return
                code = error.code() if hasattr(error, "code") else None
                details = error.details() if hasattr(error, "details") else str(error)
                name = code.name if code is not None else "UNKNOWN"
                if name == "FAILED_PRECONDITION":
                    if self.current().incarnation != current.incarnation:
                        continue  # a takeover changed the incarnation meanwhile
                    if current.role == config_pb2.SPARE and self.wait_change(current, 2.0):
                        continue  # fenced as REPLACED by its own takeover
                    self.fenced(details)
                if name in ("UNAUTHENTICATED", "PERMISSION_DENIED"):
                    self.end(rebound.EXIT_REJECTED,
                             "the server refuses this worker's heartbeat: %s" % details)
                    return
                if name == "ABORTED":
                    # The server lost this registration (restarted without its state): the
                    # simplest safe course for a Python worker is to leave; its supervisor
                    # starts it again as a new worker.
                    self.end(rebound.EXIT_UNREACHABLE,
                             "the server no longer knows this worker (%s); exiting" % details)
                    return
                if time.monotonic() - last_contact > self.options.give_up_after_s:
                    self.end(rebound.EXIT_UNREACHABLE, "no heartbeat acknowledged for %.0f s: %s"
                             % (self.options.give_up_after_s, details))
                    return
                self.stop.wait(backoff.next())
                continue
            backoff.reset()
            last_contact = time.monotonic()
            if response.HasField("takeover"):
                takeover = response.takeover
                _log("taking over slot (%d, %d) as incarnation %d from step %d (from the center)"
                     % (takeover.slot.replica, takeover.slot.stage, takeover.incarnation,
                        takeover.start_step))
                self.adopt(takeover)
            if current.role == config_pb2.TRAINER and not response.HasField("takeover"):
                with self.lock:
                    if self.registration.incarnation == current.incarnation:
                        self.start_held = response.hold_start
                    if not self.start_held:
                        self.changed.notify_all()
            for command in response.commands:
                if command == rebound_pb2.DRAIN:
                    with self.lock:
                        self.drain = True
                elif command == rebound_pb2.STOP:
                    with self.lock:
                        self.job_done = True
                    self.stop.set()
                elif command == rebound_pb2.PREEMPT_AUDIT:
                    with self.lock:
                        preempt = self._auditing and not self._audit_preempted
                        if preempt:
                            self._audit_preempted = True
                    if preempt:
                        _log("the server needs this spare for a recovery: stopping the audit")
            with self.lock:
                held = self.start_held
            # While the start barrier holds, beat often: trainers start within one such beat.
            self.stop.wait(min(interval, START_BARRIER_BEAT_S) if held else interval)

    def wait_for_start(self, limit_s):
        """The job's start barrier: waits until the server no longer holds this trainer's start,
        ``stop`` is set (False then) or ``limit_s`` pass (logged; True). At once when nothing
        holds it."""
        deadline = time.monotonic() + limit_s
        logged = False
        with self.lock:
            while self.start_held and not self.stop.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    _log("the start barrier still holds after %.0f s; training anyway" % limit_s)
                    return True
                if not logged:
                    _log("waiting for the job's other trainers (the start barrier, "
                         "topology.min_trainers)")
                    logged = True
                self.changed.wait(min(left, 0.05))
        return not self.stop.is_set()

    def wait_change(self, current, timeout):
        deadline = time.monotonic() + timeout
        with self.lock:
            while self.registration.incarnation == current.incarnation:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.changed.wait(left)
            return True

    def deregister(self, drained=False):
        current = self.current()
        if current is None:
            return
        self.leaving = True
        self.stop.set()
        try:
            self.conn.stub.Deregister(
                rebound_pb2.DeregisterRequest(incarnation=current.incarnation, drained=drained),
                timeout=min(self.options.rpc_deadline_s, 2.0), metadata=self.conn.metadata())
        except Exception as error:  # grpc.RpcError
            _log("deregister failed: %s" % error)
        # After the Deregister: the session's end is then no crash.
        self._end_session()
