from qtool.cli import entry

entry()
