# The Python base for hosts without Docker Hub (scripts/docker-images.sh builds it): Debian
# bookworm's python3 from a debootstrap rootfs (ROOTFS_IMAGE, made by `docker import`), plus the
# host's CA bundle, so pip and apt inside builds trust what the host trusts (a site proxy may
# re-sign TLS with its own CA).
ARG ROOTFS_IMAGE
FROM ${ROOTFS_IMAGE}
COPY ca-certificates.crt /etc/ssl/certs/ca-certificates.crt
# The image's Python is ours to install into (in a venv: see Dockerfile), not the distribution's.
RUN rm -f /usr/lib/python3*/EXTERNALLY-MANAGED
ENV LANG=C.UTF-8
CMD ["python3"]
