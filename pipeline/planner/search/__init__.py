"""`plan=auto` and `scheduler=auto`: the candidates built from the config groups' options, planned, predicted and ranked."""
