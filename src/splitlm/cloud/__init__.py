"""The untrusted cloud: serves the middle layers to many edge sessions."""
