"""Wire format shared by the edge and the cloud: frames, tensor codecs, error codes, and its security:
identity keys (keys), the handshake (handshake), AES-256-GCM framing and rekeying (crypto)."""
