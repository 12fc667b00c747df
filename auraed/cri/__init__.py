"""The Kubernetes CRI (runtime.v1) served to a kubelet: pods, their containers, images, streaming."""
