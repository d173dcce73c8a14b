"""ficache's Alembic environment (installed as ``ficache.migrations``).

Revision files under ``versions/`` own the registry schema. Ids are
readable (``0001_registry``) and each is tied to the release that adds it.
"""
