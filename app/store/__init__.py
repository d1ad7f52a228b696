"""What the app keeps between runs: the SQLite history, the settings, the quality results. No widgets: QtCore only,
for QSettings and translated messages."""
