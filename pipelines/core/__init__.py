"""The ground floor: every path and fixed name, params.yaml, atomic I/O, logs, errors, process isolation, the code sandbox and lineage; every stage stands on it."""
