"""Every error ficache raises on purpose.

Invariants:
- Each class is a ``FicacheError``; its message is one line that says what
  went wrong and what to do next. The CLI prints that line and exits 1; the
  startup protocol turns it into "tune uncached" and logs it.
- An error raised while writing means the registry is exactly as it was:
  writers raise only before or by rolling back their one transaction.
"""

from __future__ import annotations


class FicacheError(Exception):
    """Base class: a failure ficache understands and can explain in one line.

    ``transient`` says whether the same work may succeed if tried again a moment
    later (a server refusing connections for now, a serialization failure); only
    ``ficache.schema.translate_operational_error`` sets it, and only
    ``ficache.retrying`` acts on it.
    """

    transient: bool = False


class RegistryError(FicacheError):
    """The registry cannot be opened, read or written."""


class NotARegistryError(RegistryError):
    """The path given as a registry is not a SQLite database."""


class RegistryReadOnlyError(RegistryError):
    """A write was asked of a registry this process may only read."""


class RegistryUnavailableError(RegistryError):
    """A registry server could not be reached or refused the connection (its cause named).

    ``remedy`` is the message's last part, what to do next.
    """

    remedy: str = ""


class RegistryDamagedError(RegistryError):
    """SQLite reports the registry file damaged (``PRAGMA quick_check``); nothing is written
    to it (``ficache.registry.damaged_error``)."""


class RegistryBusyError(RegistryError):
    """Another writer held the registry longer than the busy timeout."""


class RegistryTimeoutError(RegistryError):
    """A registry server did not answer within the client's deadline (``ficache.deadline``)."""


class SchemaTooNewError(RegistryError):
    """The registry was written by a newer ficache; it is left untouched."""


class SchemaError(RegistryError):
    """The registry's schema is not one this ficache can use."""


class SchemaTooOldError(SchemaError):
    """The registry's schema is older than this ficache and only ``ficache db upgrade`` may move it."""


class CacheFileError(FicacheError):
    """A FlashInfer cache file is unreadable, malformed or hostile."""


class FingerprintError(FicacheError):
    """A fingerprint could not be collected, parsed or found."""


class NotFoundError(FicacheError):
    """A commit, fingerprint or entry named by the user does not exist."""


class ConflictError(FicacheError):
    """An operation would overwrite work done after the state it expects."""


class StalePlanError(ConflictError):
    """Another writer changed rows a plan expected, between the plan and its write.

    Nothing was written. Planning again against the registry as it is now
    is safe where no person confirmed the first plan (``merge`` does so).
    """


class TunerError(FicacheError):
    """The autotuner refused or failed an operation (FlashInfer rejected a cache, say)."""


class BundleError(FicacheError):
    """A ficache bundle is unreadable, damaged, truncated, foreign, hostile or too new."""


class MergeConflictError(ConflictError):
    """A merge under ``--on-conflict fail`` found conflicting entries; nothing changed."""


class V2StoreError(FicacheError):
    """A FlashInfer managed (v2) store cannot be read as one, or written here."""


class VllmCacheError(FicacheError):
    """A path given as vLLM's cache root cannot be searched for its autotune caches."""


class RecordError(FicacheError):
    """A namespaced record (FlashInfer ``_records``) is not one ficache can store."""
