"""The base of training/: the run config's value rules and the error they raise (values), and how a schema key is
declared (keys). Nothing else of training/ is imported here, so every part may use them."""
