"""Privacy audit: how much of the text can a party that sees the split's activations recover?

`data` splits a corpus into public (train) and held-out text, `views` cuts a model into the
parts the edge and the cloud run, `attacks` recovers tokens from activations, `defences`
changes what the cloud receives and measures the quality cost, `harden` trains a private head,
`run` puts them together and `report` writes report.md, audit.json and a plot.
"""
