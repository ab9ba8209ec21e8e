"""What the tests' ranks run: functions a launch imports by module and name (tests/ is on
every rank's path), one module per area, and a script torchrun runs (finish_torchrun.py)."""
