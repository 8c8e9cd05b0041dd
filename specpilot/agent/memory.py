"""The search's memory: every trial in a SQLite store (stdlib sqlite3, write-ahead log).

One row a trial: the run and round, the deployment's fingerprint, the pipeline (and the rules texts
it needs), who proposed it, the predicted and measured times, τ, the token-forcing verdict, the
status and its reason, and the specpilot commit. Rows are appended, one transaction each, and never
rewritten except to mark a validated trial as a mechanism once its round has judged it (`improved`).

A mechanism is a pipeline that improved measured speed over the round's incumbent with token
forcing passing (`improved = 1`); `mechanisms(fingerprint)` returns those validated on the nearest
fingerprints, best first, which is what a new deployment's first round is seeded with.

Durability: WAL journal with `synchronous=FULL`, so a committed trial survives the process being
killed (kill -9) mid-round; a busy timeout lets several processes (workers, concurrent searches)
append at once, each insert retried inside SQLite's own locking.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ..errors import SpecpilotError
from .fingerprint import Fingerprint

SCHEMA = """
CREATE TABLE IF NOT EXISTS trials (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    run TEXT NOT NULL,
    round INTEGER NOT NULL,
    trial INTEGER NOT NULL,
    fingerprint TEXT NOT NULL,
    fp_key TEXT NOT NULL,
    pipeline TEXT NOT NULL,
    rules TEXT NOT NULL DEFAULT '[]',
    proposer TEXT NOT NULL,
    status TEXT NOT NULL,
    reason TEXT NOT NULL DEFAULT '',
    predicted_ms REAL,
    calibrated_ms REAL,
    measured_ms REAL,
    ar_ms REAL,
    relative REAL,
    tau REAL,
    forcing TEXT NOT NULL DEFAULT '',
    forcing_passed INTEGER NOT NULL DEFAULT 0,
    improved INTEGER NOT NULL DEFAULT 0,
    commit_id TEXT NOT NULL DEFAULT '',
    created REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS trials_fp ON trials (fp_key);
CREATE INDEX IF NOT EXISTS trials_run ON trials (run);
"""

COLUMNS = ("run", "round", "trial", "fingerprint", "fp_key", "pipeline", "rules", "proposer", "status", "reason",
           "predicted_ms", "calibrated_ms", "measured_ms", "ar_ms", "relative", "tau", "forcing", "forcing_passed",
           "improved", "commit_id", "created")


class MemoryStoreError(SpecpilotError):
    """The memory file cannot be opened as a store (not SQLite, not writable)."""


@dataclass(frozen=True)
class Mechanism:
    pipeline: str
    rules: tuple[tuple[str, str], ...]
    relative: float  # its measured engine/AR ratio where it was validated
    distance: float  # how far its deployment is from the one asking
    fingerprint: Fingerprint


class Memory:
    """The SQLite trial store at `path` (created on first use)."""

    def __init__(self, path: str | Path, timeout_s: float = 30.0):
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.db = sqlite3.connect(self.path, timeout=timeout_s, isolation_level=None)
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=FULL")
            self.db.execute(f"PRAGMA busy_timeout={int(timeout_s * 1000)}")
            with self.transaction() as db:
                for statement in _statements(SCHEMA):
                    db.execute(statement)
        except sqlite3.DatabaseError as e:
            raise MemoryStoreError(f"{self.path}: not a specpilot memory store ({e}); expected a SQLite file or a new "
                               f"path") from None
        except OSError as e:
            raise MemoryStoreError(f"{self.path}: cannot open the memory store ({e})") from None

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        self.db.execute("BEGIN IMMEDIATE")
        try:
            yield self.db
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    def close(self) -> None:
        self.db.close()

    def record(self, **row) -> int:
        """Append one trial (keys of COLUMNS; `fingerprint` a Fingerprint, `rules` pairs); its id."""
        fp: Fingerprint = row.pop("fingerprint")
        values = {"fingerprint": fp.to_json(), "fp_key": fp.key, "rules": json.dumps(row.pop("rules", [])),
                  "created": time.time(), **row}
        values["forcing_passed"] = int(bool(values.get("forcing_passed", 0)))
        values["improved"] = int(bool(values.get("improved", 0)))
        cols = [c for c in COLUMNS if c in values]
        with self.transaction() as db:
            cur = db.execute(f"INSERT INTO trials ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))})",
                             [values[c] for c in cols])
            return int(cur.lastrowid)

    def mark_improved(self, row_id: int) -> None:
        with self.transaction() as db:
            db.execute("UPDATE trials SET improved = 1 WHERE id = ? AND forcing_passed = 1", (row_id,))

    def trials(self, run: str | None = None, fp_key: str | None = None) -> list[dict]:
        query, args = "SELECT * FROM trials", []
        where = []
        if run is not None:
            where.append("run = ?")
            args.append(run)
        if fp_key is not None:
            where.append("fp_key = ?")
            args.append(fp_key)
        if where:
            query += " WHERE " + " AND ".join(where)
        cur = self.db.execute(query + " ORDER BY id", args)
        names = [d[0] for d in cur.description]
        return [dict(zip(names, r)) for r in cur.fetchall()]

    def count(self) -> int:
        return int(self.db.execute("SELECT COUNT(*) FROM trials").fetchone()[0])

    def integrity(self) -> str:
        return str(self.db.execute("PRAGMA integrity_check").fetchone()[0])

    def mechanisms(self, fp: Fingerprint, limit: int = 8, max_distance: float = 6.0) -> list[Mechanism]:
        """Pipelines validated as improvements on the fingerprints nearest `fp` (nearest first, then
        fastest relative to AR); one entry a pipeline."""
        cur = self.db.execute("SELECT fingerprint, pipeline, rules, MIN(relative) FROM trials WHERE improved = 1 "
                              "AND forcing_passed = 1 GROUP BY fingerprint, pipeline")
        found: dict[str, Mechanism] = {}
        for fp_json, pipeline, rules, relative in cur.fetchall():
            other = Fingerprint.from_json(fp_json)
            d = fp.distance(other)
            if d > max_distance:
                continue
            m = Mechanism(pipeline, tuple(tuple(r) for r in json.loads(rules)), float(relative or 0.0), d, other)
            if pipeline not in found or (d, m.relative) < (found[pipeline].distance, found[pipeline].relative):
                found[pipeline] = m
        return sorted(found.values(), key=lambda m: (m.distance, m.relative))[:limit]

    def summary(self) -> list[dict]:
        """Per fingerprint: trials, validated, rejected, failed, mechanisms, and the best pipeline."""
        out = []
        for fp_json, fp_key in self.db.execute("SELECT DISTINCT fingerprint, fp_key FROM trials ORDER BY fp_key"):
            rows = self.trials(fp_key=fp_key)
            best = min((r for r in rows if r["forcing_passed"] and r["relative"]), key=lambda r: r["relative"],
                       default=None)
            out.append({"fingerprint": json.loads(fp_json), "trials": len(rows),
                        "validated": sum(r["status"] == "validated" for r in rows),
                        "rejected": sum(r["status"] == "rejected" for r in rows),
                        "failed": sum(r["status"] == "failed" for r in rows),
                        "mechanisms": sum(r["improved"] for r in rows),
                        "best_pipeline": best["pipeline"] if best else None,
                        "best_relative": best["relative"] if best else None,
                        "runs": len({r["run"] for r in rows})})
        return out


def _statements(script: str) -> list[str]:
    return [s.strip() for s in script.split(";") if s.strip()]
