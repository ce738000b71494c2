"""One module per `mixprec` subcommand (see mixprec.cli)."""
