"""The doctor's checks, one file per group; only `quantgate doctor` imports them."""
