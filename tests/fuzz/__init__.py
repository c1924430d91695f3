"""Schema fuzzing of the gateway (schemathesis) against real processes: the short profile that CI runs."""
