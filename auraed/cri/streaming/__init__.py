"""The CRI streaming server: Exec, Attach and PortForward over SPDY/3.1 and WebSocket.

The CRI's Exec, Attach and PortForward RPCs only hand out a URL of this server with a one-time
token (``StreamingServer.url_for``); the client (a kubelet, crictl, critest) then dials the URL and
speaks the kubelet's remotecommand or portforward protocol over an upgraded HTTP/1.1 connection.
What runs behind the streams is a ``StreamingBackend`` (``backend.py``).
"""
