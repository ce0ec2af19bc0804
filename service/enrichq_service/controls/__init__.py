"""Operator controls over the queue: cancel, dlq discard and dlq redrive by one filter
(`actions`, `filters`), pause and resume (`pauses`), and the dead-letter listing (`dlq`).
Each is a repository of statements over `enrichq.queue` and a pure core; the commands
that run them are `enrichq_service.commands.controls`."""
