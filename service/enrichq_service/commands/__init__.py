"""The `enrichq` commands, one module per verb family, each shaped alike: check the
options (one line, exit 2, before any connection), open the database in one place, call a
domain function that returns a record, render the record to the command's writer, return
an exit code. `enrichq_service.cli` only declares them to click."""
