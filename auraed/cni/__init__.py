"""Pod networking through CNI, the container network plugin protocol, spoken by hand.

``Cni`` (cni.py) is what a pod sandbox calls: ``attach`` (ADD), ``check`` (CHECK), ``detach``
(DEL), ``status`` (the CRI's NetworkReady). config.py reads conf dirs and finds plugins,
invoke.py runs plugins and chains them, result.py types their results, model.py holds the
settings and what a pod asks for.
"""
