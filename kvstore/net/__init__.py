"""The store's wire: the frame protocol (spec in protocol.py), the daemon's socket server,
and a client connection with what a put/get accepts as buffers."""
