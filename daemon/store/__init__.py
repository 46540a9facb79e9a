"""The one persisted state: SQLite jobs, attempts and events, the state table, and retried writes."""
