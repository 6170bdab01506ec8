"""Sender-side step logging of a Python trainer (docs/design.md §5.2): records are appended without
waiting for the network; a background thread ships what gathered every ``linger_ms`` as one
AppendLog batch and drops what the server acknowledged (``acked_through``); unacknowledged
records are sent again after an error. The buffer is bounded by ``buffer_bytes``: ``append``
waits for room up to give_up_after_s, then raises WorkerExit(4).

A batch refused as FAILED_PRECONDITION (the sender is fenced) ends the logger; one refused as
INVALID_ARGUMENT is a bug of the client and ends the work with code 1 (``Session.end``: the
process at once, or the session, whose work thread then returns the code).

Thread-safety: ``append``, ``flush`` and ``close`` may be called from any thread.
"""

import collections
import threading
import time

import rebound
from rebound import client as rclient
from rebound_pb import rebound_pb2

_log = rclient.log
_Exit = rclient.WorkerExit



class StepLog:
    """Sender-side step logging (docs/design.md §5.2): append() never blocks on the network; a thread
    ships what gathered every linger_ms as one AppendLog batch and drops what the server
    acknowledged. The buffer is bounded (step_log.buffer_bytes): append() waits for room, up to
    give_up_after_s."""

    def __init__(self, conn, options, incarnation, step_log_config, session):
        self.conn = conn
        self.options = options
        self.incarnation = incarnation
        self.linger_s = step_log_config.linger_ms / 1000.0
        self.capacity = step_log_config.buffer_bytes
        self.session = session
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.pending = collections.deque()  # (record_id, LogRecord, bytes)
        self.pending_bytes = 0
        self.next_id = 1
        self.acked = 0
        self.closed = False
        self.thread = threading.Thread(target=self._ship, name="rebound-steplog", daemon=True)
        self.thread.start()

    def append(self, records):
        size = sum(r.ByteSize() for r in records)
        deadline = time.monotonic() + self.options.give_up_after_s
        with self.lock:
            while self.pending_bytes + size > self.capacity and self.pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise _Exit(rebound.EXIT_UNREACHABLE,
                                "the step log's buffer stayed full for %.0f s" %
                                self.options.give_up_after_s)
                self.cond.wait(min(left, 1.0))
            for record in records:
                record.record_id = self.next_id
                record.sender_incarnation = self.incarnation
                self.next_id += 1
                self.pending.append((record.record_id, record, record.ByteSize()))
            self.pending_bytes += size
            self.session.log_pending = self.pending_bytes
            self.cond.notify_all()

    def flush(self, timeout_s):
        deadline = time.monotonic() + timeout_s
        with self.lock:
            target = self.next_id - 1
            self.cond.notify_all()
            while self.acked < target:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.cond.wait(left)
        return True

    def close(self):
        with self.lock:
            self.closed = True
            self.cond.notify_all()
        self.thread.join(timeout=self.options.rpc_deadline_s)

    def _ship(self):
        backoff = rclient.Backoff(self.options.backoff_initial_s, self.options.backoff_max_s)
        while True:
            with self.lock:
                while not self.pending and not self.closed:
                    self.cond.wait()
                if not self.pending and self.closed:
                    return
            if self.linger_s > 0 and not self.closed:
                time.sleep(self.linger_s)
            with self.lock:
                batch = [record for _, record, _ in list(self.pending)[:4096]]
            if not batch:
                continue
            request = rebound_pb2.AppendLogRequest(incarnation=self.incarnation, records=batch)
            try:
                ack = self.conn.bidi_once("AppendLog", request)
            except rclient.CallError as error:
                if error.code.name == "FAILED_PRECONDITION":
                    _log("the step log was refused: %s" % error)
                    with self.lock:
                        self.closed = True
                        self.pending.clear()
                        self.cond.notify_all()
                    return
                if error.code.name == "INVALID_ARGUMENT":
                    with self.lock:
                        self.closed = True
                        self.pending.clear()
                        self.cond.notify_all()
                    self.session.end(rebound.EXIT_FAILED,
                                     "the server refused a step-log batch: %s" % error)
                    return
                time.sleep(backoff.next())
                continue
            backoff.reset()
            with self.lock:
                self.acked = max(self.acked, ack.acked_through)
                while self.pending and self.pending[0][0] <= self.acked:
                    self.pending_bytes -= self.pending.popleft()[2]
                self.session.log_pending = self.pending_bytes
                self.cond.notify_all()
