"""Wire format shared by the edge and the cloud: frames, tensor codecs, error codes."""
