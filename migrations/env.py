"""Alembic environment: migrations run on the caller's connection.

``ficache.schema`` builds the Alembic ``Config`` in code, opens the
connection, takes the registry's write lock and passes the connection as
``config.attributes["connection"]``; this file only runs the revisions on it,
inside the transaction the caller already began. There is no ini file.
Offline mode (``ficache db upgrade --sql``, ``schema.upgrade_sql``) writes the
SQL for the dialect named in ``config.attributes["offline_dialect"]``.
"""

from alembic import context

from ficache.models import Base

if context.is_offline_mode():
    dialect = context.config.attributes["offline_dialect"]
    context.configure(
        dialect_name=dialect,
        target_metadata=Base.metadata,
        literal_binds=True,
        render_as_batch=dialect == "sqlite",
        transactional_ddl=True,
    )
    with context.begin_transaction():
        context.run_migrations()
else:
    connection = context.config.attributes.get("connection")
    if connection is None:  # pragma: no cover - guarded by ficache.schema
        raise RuntimeError("ficache migrations run only through ficache.schema (ficache db ...)")

    context.configure(
        connection=connection,
        target_metadata=Base.metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()
