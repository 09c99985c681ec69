"""CLI: flags and help, sweeps, pre-flight checks, the job runner."""
