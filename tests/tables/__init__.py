"""Table sources: Parquet and Arrow IPC files."""
