"""The `ciuic-train` command, one step per module.

`main` (the entry point) reads the command's flags (`flags`), answers what only prints
(`help`), checks every job before Hydra runs (`preflight`, with `sweeps` expanding -m and
`compose` completing each job's config; `messages` turns mistakes into one line), then
hands over to Hydra, whose job trains (`job`).
"""
